"""Running untrusted generated code: one fresh process per sample, in a scratch folder of its own.

Layers, each covering what the one before may miss:

- **Process limits** (set in the child before it runs anything): CPU seconds, address space,
  the size of any file it writes, open files, no core dumps; for a non-root user also the
  number of processes. A wall-clock timeout on top, and the child leads its own session, so
  everything it started is killed with it (a process tree does not outlive the sample).
- **No network**: where the kernel allows it, the child enters a network namespace of its own
  (no interface but a down loopback: a connection cannot even start).
- **A guard in the interpreter** (`python -I`, isolated from the user's environment and
  site-packages), installed before the sample: files open for writing only inside the scratch
  folder, no deleting or renaming outside it, no sockets, no `fork`/`exec`/`subprocess`/
  `os.system`, no `ctypes` (which would undo the guard). This is the layer evaluation
  harnesses use; alone it is not a security boundary, and it is not alone here.

The result says how the sample ended: `passed`, `failed` (an exception or a non-zero exit),
`timeout`, or `killed` (a limit's signal: CPU time, file size, memory).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000

GUARD = r"""
import builtins, io, os, sys
_scratch = os.path.realpath(os.getcwd())
_open = builtins.open
_os_open = os.open

def _inside(path):
    try:
        real = os.path.realpath(os.fspath(path))
    except TypeError:
        return False
    return real == _scratch or real.startswith(_scratch + os.sep)

def _refuse(what):
    def refused(*args, **kwargs):
        raise PermissionError(f"sandbox: {what} is not allowed")
    return refused

def _guarded_open(file, mode="r", *args, **kwargs):
    if isinstance(file, int):
        return _open(file, mode, *args, **kwargs)
    if any(c in mode for c in "wax+") and not _inside(file):
        raise PermissionError(f"sandbox: writing {file} (outside the scratch folder)")
    return _open(file, mode, *args, **kwargs)

def _guarded_os_open(path, flags, *args, **kwargs):
    writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
    if writes and not _inside(path):
        raise PermissionError(f"sandbox: writing {path} (outside the scratch folder)")
    return _os_open(path, flags, *args, **kwargs)

def _inside_only(name):
    real = getattr(os, name)
    def checked(*paths, **kwargs):
        for p in paths[:2]:
            if isinstance(p, (str, bytes, os.PathLike)) and not _inside(p):
                raise PermissionError(f"sandbox: {name} outside the scratch folder")
        return real(*paths, **kwargs)
    return checked

builtins.open = io.open = _guarded_open
os.open = _guarded_os_open
for _name in ("remove", "unlink", "rmdir", "rename", "replace", "removedirs", "truncate",
              "chmod", "chown", "symlink", "link", "mkdir", "makedirs", "utime"):
    if hasattr(os, _name):
        setattr(os, _name, _inside_only(_name))
for _name in ("fork", "forkpty", "system", "popen", "execv", "execve", "execl", "execle",
              "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl",
              "spawnle", "spawnlp", "spawnlpe", "spawnvp", "spawnvpe", "posix_spawn",
              "posix_spawnp", "kill", "killpg", "setuid", "setgid", "chroot", "chdir"):
    if hasattr(os, _name):
        setattr(os, _name, _refuse(f"os.{_name}"))
import socket, subprocess, shutil
socket.socket = _refuse("a socket")
socket.create_connection = _refuse("a network connection")
subprocess.Popen = _refuse("a subprocess")
subprocess.run = subprocess.call = subprocess.check_call = subprocess.check_output = _refuse("a subprocess")
_rmtree = shutil.rmtree
def _guarded_rmtree(path, *args, **kwargs):
    if not _inside(path):
        raise PermissionError("sandbox: rmtree outside the scratch folder")
    return _rmtree(path, *args, **kwargs)
shutil.rmtree = _guarded_rmtree
for _mod in ("ctypes", "_ctypes", "resource", "multiprocessing", "_posixsubprocess", "pty",
             "_socket"):
    sys.modules[_mod] = None
del _name, _mod
sys.argv = ["program.py"]
_code = compile(_open("program.py").read(), "program.py", "exec")
exec(_code, {"__name__": "__main__", "__builtins__": builtins})
"""


@dataclass(frozen=True)
class Limits:
    """What one sample may use."""

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    open_files: int = 64
    processes: int = 1  # besides itself; enforced by the kernel for non-root users


@dataclass
class Outcome:
    status: str  # passed | failed | timeout | killed
    returncode: int | None
    seconds: float
    stderr_tail: str
    network_isolated: bool


def _enter_namespace() -> bool:
    """A network namespace of its own for this process (False where the kernel refuses)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        flags = _CLONE_NEWNET if os.geteuid() == 0 else _CLONE_NEWNET | _CLONE_NEWUSER
        return libc.unshare(flags) == 0
    except (OSError, AttributeError):
        return False


def _child_setup(limits: Limits, status_fd: int) -> None:
    """In the child, between fork and exec: limits, then the namespace."""
    cap = [
        (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
        (resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes)),
        (resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes)),
        (resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if os.geteuid() != 0:
        running = len(os.listdir("/proc")) if os.path.isdir("/proc") else 0
        cap.append((resource.RLIMIT_NPROC, (running + limits.processes,) * 2))
    for what, value in cap:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(what, value)
    isolated = _enter_namespace()
    os.write(status_fd, b"1" if isolated else b"0")
    os.close(status_fd)


def run_program(source: str, limits: Limits | None = None, keep: Path | None = None) -> Outcome:
    """Run Python `source` in a fresh sandboxed process (see module doc)."""
    limits = limits or Limits()
    scratch = tempfile.TemporaryDirectory(prefix="crossdistill-sandbox-")
    folder = Path(scratch.name)
    (folder / "program.py").write_text(source, encoding="utf-8")
    (folder / "guard.py").write_text(GUARD, encoding="utf-8")
    read_fd, write_fd = os.pipe()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(folder), "TMPDIR": str(folder), "LANG": "C.UTF-8"}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-I", "-B", "guard.py"],
        cwd=folder,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        pass_fds=(write_fd,),
        preexec_fn=lambda: _child_setup(limits, write_fd),  # noqa: PLW1509
    )
    os.close(write_fd)
    timed_out = False
    try:
        _, err = proc.communicate(timeout=limits.timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        _, err = proc.communicate()
    finally:
        _kill_group(proc.pid)  # whatever it started
        isolated = os.read(read_fd, 1) == b"1"
        os.close(read_fd)
    seconds = time.perf_counter() - started
    code = proc.returncode
    if timed_out:
        status = "timeout"
    elif code == 0:
        status = "passed"
    elif code is not None and code < 0:
        status = "killed"
    else:
        status = "failed"
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / "program.py").write_text(source, encoding="utf-8")
    scratch.cleanup()
    tail = err.decode("utf-8", "replace")[-2000:] if err else ""
    return Outcome(status, code, seconds, tail, isolated)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
