"""The rooms and what each may import (docs/architecture.md), read from the source: no import cycle, function-level
imports included (type-checking ones aside); the torch-free rooms import no torch; Slurm's commands are run from
one module only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runconfig", "storage", "rundir", "tracking", "hpc", "trainer", "bench")
#: room -> the project's rooms it may import (bench: every room, it measures them)
MAY_IMPORT = {
    "runconfig": set(),
    "storage": {"runconfig"},
    "rundir": {"runconfig", "storage"},
    "tracking": {"runconfig", "storage", "rundir"},
    "hpc": {"runconfig", "storage", "rundir", "tracking"},
    "trainer": {"runconfig", "storage", "rundir", "tracking"},
}
TORCH_FREE = ("runconfig", "storage", "rundir", "tracking", "hpc")
SLURM_COMMANDS = {"scontrol", "squeue", "sacct", "scancel", "sbatch", "sinfo"}
SLURM_DOOR = "hpc.slurmctl"


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, at any level of the file (names outside the project kept whole)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` blocks import nothing at run time
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # a submodule, else a name defined in the module ``base``
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return out


def _project(dotted: str) -> str | None:
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


GRAPH = {name: {m for m in map(_project, _imports(name, path)) if m and m != name} for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_function_level_imports_included():
    assert _cycles() == []


@pytest.mark.parametrize("room", sorted(MAY_IMPORT))
def test_each_room_imports_only_the_rooms_below_it(room):
    wrong = sorted(
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        if name.split(".")[0] == room
        for dep in deps
        if dep.split(".")[0] != room and dep.split(".")[0] not in MAY_IMPORT[room]
    )
    assert wrong == []


@pytest.mark.parametrize("room", TORCH_FREE)
def test_torch_free_rooms_import_no_torch(room):
    heavy = sorted(
        f"{name} imports {dep}"
        for name, path in MODULES.items()
        if name.split(".")[0] == room
        for dep in _imports(name, path)
        if dep.split(".")[0] == "torch"
    )
    assert heavy == []


def test_slurm_commands_are_run_from_one_module():
    """A command line that starts with a Slurm command (``["scontrol", ...]``) is built only in hpc/slurmctl.py
    (submitit's sbatch and the driver's srun step aside)."""
    outside = []
    for name, path in MODULES.items():
        if name == SLURM_DOOR or name.split(".")[0] == "bench":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            first = node.elts[0] if isinstance(node, (ast.List, ast.Tuple)) and node.elts else None
            if isinstance(first, ast.Constant) and first.value in SLURM_COMMANDS:
                outside.append(f"{path.relative_to(ROOT)}:{node.lineno}: {first.value!r}")
    assert outside == []


def test_every_name_imported_from_the_project_exists():
    """A module moved or a name renamed breaks no import left behind (function-level ones included, which only
    run when their function does)."""
    import importlib

    missing = []
    for name, path in MODULES.items():
        if name.endswith("__main__"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and _project(node.module or "")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and f"{node.module}.{alias.name}" not in MODULES:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    assert missing == []
