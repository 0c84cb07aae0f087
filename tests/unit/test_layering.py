"""The package imports downwards only: each part of it may use the parts below it and never one
above (imports inside functions count too), and no two modules import each other, directly or
through others. A layer's `__init__` docstring says what it holds."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "crossdistill"
# lowest first; a part may import its own layer's other parts only where listed together
LAYERS = [
    {"errors"},
    {"config", "cache"},
    {"models", "losses"},
    {"alignment"},
    {"data"},
    {"distributed"},
    {"eval"},
    {"train"},
    {"bench"},
    {"cli", "config_cli", "__main__"},
]
ALLOWED_SIDEWAYS = {("cli", "config_cli"), ("__main__", "cli")}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every crossdistill module `path` imports, at any depth of its code."""
    found = set()
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            if name.startswith("crossdistill"):
                found.add(name)
                found.update(f"{name}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("crossdistill"))
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "crossdistill"


def _layer(part: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if part in names)


def test_every_part_has_a_layer_and_a_docstring():
    for path in PACKAGE.iterdir():
        name = path.stem
        if name.startswith("_") and name != "__main__" or path.suffix not in ("", ".py"):
            continue
        assert any(name in names for names in LAYERS), f"{name} has no layer in this test"
        if path.is_dir():
            doc = ast.get_docstring(ast.parse((path / "__init__.py").read_text(encoding="utf-8")))
            assert doc and len(doc) > 40, (
                f"{name}/__init__.py needs a docstring saying what it holds"
            )


def test_parts_import_downwards_only():
    wrong = []
    for module, targets in _graph().items():
        src = _part(module)
        if src == "crossdistill":
            continue
        for target in targets:
            dst = _part(target)
            if dst in (src, "crossdistill") or (src, dst) in ALLOWED_SIDEWAYS:
                continue
            if _layer(dst) >= _layer(src):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = _graph()
    # a package's __init__ re-exports its modules: the edges from a package to its own
    # modules are how Python loads it, not a dependency of those modules on the package
    graph = {
        m: {
            t
            for t in ts
            if not (t.startswith(m + ".") and (PACKAGE.parent / m.replace(".", "/")).is_dir())
        }
        for m, ts in graph.items()
    }
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
