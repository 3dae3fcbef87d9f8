"""Does the code use torch API that an older torch lacks? A static check of the declared range (``torch>=2.6``).

``python envs/torch_api_check.py --version 2.6.0`` downloads that torch wheel (pip, no dependencies; ~770 MB),
unpacks its Python sources into a temporary folder and compares, for every use of torch in trainer/, runconfig/,
bench/, examples/ and tests/ (``import torch.x``, ``from torch.x import y``, attribute chains through the import
aliases such as ``dist.all_reduce``, and the keyword arguments of calls into torch), whether the installed torch
defines it and the older one does not. ``--torch-src DIR`` uses an already unpacked tree (the folder holding
``torch/``). Prints each gap with the files that use it; exit status 1 if any.

Heuristic, torch-free and import-free: a name counts as defined where the module's source defines, assigns or
imports it (following ``from .x import *``), so names made only in C (``torch.zeros``) are not judged, and a
function taking ``**kwargs`` accepts any keyword. It found, on torch 2.6.0, the gap a GPU machine's torch 2.11 hit
at run time (``dist.reduce_scatter_single``, new in 2.13; since replaced by a fallback).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("trainer", "runconfig", "rundir", "storage", "tracking", "bench", "examples", "tests")


def module_file(root: Path, dotted: str) -> Path | None:
    p = root.joinpath(*dotted.split("."))
    for candidate in (p.with_suffix(".py"), p / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def star_targets(root: Path, dotted: str, src: str, name: str | None = None) -> list[str]:
    """Modules this one re-exports from: ``from X import *`` (or, with ``name``, ``from X import ..., name``)."""
    f = module_file(root, dotted)
    package = dotted if f is not None and f.name == "__init__.py" else dotted.rsplit(".", 1)[0]
    out = []
    for m in re.finditer(r"^\s*from\s+(\.*)([\w.]*)\s+import\s+([^\n(]*|\([^)]*\))", src, re.M):
        dots, rel, names = m.group(1), m.group(2), m.group(3).split("#")[0].strip()
        if names != "*" and (name is None or not re.search(rf"\b{name}\b", names)):
            continue
        if dots:
            base = package.split(".")[: len(package.split(".")) - (len(dots) - 1)]
            target = ".".join(base + ([rel] if rel else []))
        else:
            target = rel
        if target.startswith("torch"):
            out.append(target)
    return out


def defines(root: Path, dotted: str, name: str, depth: int = 0) -> bool | None:
    f = module_file(root, dotted)
    if f is None:
        return None
    if module_file(root, f"{dotted}.{name}"):
        return True
    src = f.read_text(errors="replace")
    n = re.escape(name)
    pattern = (
        rf"(^\s*(async\s+)?(def|class)\s+{n}\b)|(^\s*{n}\s*[:=])|(import[^\n]*\b{n}\b)|(\bas\s+{n}\b)"
        rf"|(['\"]{n}['\"])|(^\s*{n}\s*,)|(,\s*{n}\s*[,=])"
    )
    if re.search(pattern, src, re.M):
        return True
    return depth < 5 and any(defines(root, t, name, depth + 1) for t in star_targets(root, dotted, src))


def signature(root: Path, dotted: str, name: str, depth: int = 0) -> str | None:
    """The parameter list of function ``name`` (or class ``name``'s ``__init__``) in module ``dotted``."""
    f = module_file(root, dotted)
    if f is None:
        return None
    src = f.read_text(errors="replace")
    n = re.escape(name)
    for pattern in (
        rf"^\s*def\s+{n}\s*\((.*?)\)\s*(->[^:]*)?:",
        rf"^class\s+{n}\b.*?def\s+__init__\s*\((.*?)\)\s*(->[^:]*)?:",
    ):
        m = re.search(pattern, src, re.M | re.S)
        if m:
            return m.group(1)
    if depth < 5:
        for target in star_targets(root, dotted, src, name):
            found = signature(root, target, name, depth + 1)
            if found is not None:
                return found
    return None


def longest_module(root: Path, dotted: str) -> tuple[str | None, list[str]]:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if module_file(root, ".".join(parts[:i])):
            return ".".join(parts[:i]), parts[i:]
    return None, parts


def uses() -> tuple[set[tuple[str, str, str]], set[tuple[str, str, str, str]]]:
    """(full dotted name, kind, file) of every torch name used, and (module, function, keyword, file) of calls."""
    names: set[tuple[str, str, str]] = set()
    keywords: set[tuple[str, str, str, str]] = set()
    for folder in SCANNED:
        for f in sorted((ROOT / folder).rglob("*.py")):
            try:
                tree = ast.parse(f.read_text())
            except SyntaxError:
                continue
            rel = str(f.relative_to(ROOT))
            alias = {"torch": "torch"}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.startswith("torch"):
                            alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                            names.add((a.name, "module", rel))
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torch"):
                    for a in node.names:
                        alias[a.asname or a.name] = f"{node.module}.{a.name}"
                        names.add((f"{node.module}.{a.name}", "import", rel))
            for node in ast.walk(tree):
                chain, x = [], node.func if isinstance(node, ast.Call) else node
                while isinstance(x, ast.Attribute):
                    chain.append(x.attr)
                    x = x.value
                if not (isinstance(x, ast.Name) and x.id in alias):
                    continue
                full = ".".join([alias[x.id], *reversed(chain)])
                if isinstance(node, ast.Attribute):
                    names.add((full, "attribute", rel))
                elif isinstance(node, ast.Call):
                    module, _, func = full.rpartition(".")
                    keywords.update((module, func, kw.arg, rel) for kw in node.keywords if kw.arg)
    return names, keywords


def gaps(new: Path, old: Path) -> list[str]:
    names, keywords = uses()
    found: dict[str, set[str]] = {}
    for full, kind, rel in names:
        if kind == "module":
            judged = [module_file(r, full) is not None for r in (new, old)]
        else:
            module, rest = longest_module(new, full)
            if module is None or not rest:
                continue
            judged = [defines(r, module, rest[0]) for r in (new, old)]
        if judged[0] and not judged[1]:
            found.setdefault(f"{full} ({kind})", set()).add(rel)
    for module, func, kw, rel in keywords:
        resolved, rest = longest_module(new, module)
        if resolved is None or rest:
            continue
        sig_new, sig_old = signature(new, resolved, func), signature(old, resolved, func)
        if sig_new is None or sig_old is None or "**" in sig_old:
            continue
        if re.search(rf"\b{kw}\b", sig_new) and not re.search(rf"\b{kw}\b", sig_old):
            found.setdefault(f"{module}.{func}({kw}=...) (keyword)", set()).add(rel)
    return [f"{what}: {', '.join(sorted(files)[:4])}" for what, files in sorted(found.items())]


def unpack(version: str, into: Path) -> Path:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", py]
    cmd += ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64", "--platform"]
    cmd += ["manylinux_2_17_x86_64", "-d", str(into), f"torch=={version}"]
    subprocess.run(cmd, check=True)
    wheel = next(into.glob("torch-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(into / "src", [m for m in z.namelist() if m.startswith("torch/") and m.endswith(".py")])
    wheel.unlink()
    return into / "src"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--version", help="an older torch release to download and compare with, e.g. 2.6.0")
    group.add_argument("--torch-src", type=Path, help="a folder holding an older torch's torch/ sources")
    args = p.parse_args(argv)
    import torch  # the installed one: where the code is known to run

    new = Path(torch.__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        old = args.torch_src or unpack(args.version, Path(tmp))
        found = gaps(new, old)
    label = args.version or str(args.torch_src)
    if found:
        print(f"used here, defined in torch {torch.__version__}, missing from torch {label}:")
        print("\n".join(f"  {line}" for line in found))
        return 1
    print(f"no torch name or keyword used here is missing from torch {label} (against {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
