"""The recipe's code snapshot: the user's recipe package (or module) copied into ``RUN_DIR/code/`` at submit time,
and put first on the import path by every launch of the trainer.

Users edit their code while jobs wait in the queue; a queued or requeued job must run exactly the code that was
submitted. So ``python -m hpc.submit`` (and ``sbatch/train.sbatch``) copy the top-level package of the config's
``recipe: module.path:function`` (a single module with the other modules of its folder) into the run directory,
with a manifest holding a SHA-256 over the copy; the trainer calls :func:`activate` on each launch, which checks the
hash and puts ``RUN_DIR/code`` at ``sys.path[0]``.
Only the source files are copied, never imported (importing the user's module would load torch on the login
node). The built-in recipe (``gpt``) and modules that are only installed (found in none of the searched folders)
have no snapshot: they are part of the environment, not of the user's project.

Torch-free.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from runconfig.load import ConfigError
from runconfig.schema import BUILTIN_RECIPE, RECIPE_RE
from rundir.paths import RunDir
from storage.files import write_json_atomic
from storage.private import user_name

CODE_MANIFEST = "manifest.json"  # inside RUN_DIR/code/
MAX_FILE_BYTES = 20 * 1024 * 1024  # one file of the snapshot: code, not data
MAX_TOTAL_BYTES = 100 * 1024 * 1024  # the whole snapshot
MAX_FILES = 10_000  # files of the snapshot: a package, not a data tree
#: This project's own packages: installed with the trainer, never snapshotted (a copy would shadow them).
OWN_PACKAGES = frozenset({"hpc", "runconfig", "rundir", "storage", "tracking", "trainer"})


@dataclass(frozen=True)
class Snapshot:
    module: str  # top-level package or module name copied (e.g. "digits")
    sha256: str  # content hash over (relative path, bytes) of every file copied, sorted by path
    source: str  # absolute path of the original package folder or module file
    files: int


def search_path(config_file: Path | None) -> list[Path]:
    """Where a recipe module is looked for: the config file's folder, its parent, the current directory
    (absolute, deduplicated, in that order)."""
    candidates = []
    if config_file is not None:
        folder = Path(config_file).absolute().parent
        candidates += [folder, folder.parent]
    candidates.append(Path.cwd())
    out: list[Path] = []
    for path in candidates:
        path = Path(os.path.normpath(path))
        if path not in out:
            out.append(path)
    return out


def _module_of(recipe: str) -> list[str]:
    """The dotted module path of ``module.path:function``, as its parts."""
    if not RECIPE_RE.fullmatch(recipe):
        raise ConfigError(f"recipe {recipe!r} must be 'gpt' or 'package.module:function'.")
    return recipe.partition(":")[0].split(".")


def locate(recipe: str, search: list[Path]) -> Path | None:
    """The top-level package folder or module file of the recipe's module, found in ``search`` without importing
    anything, as Python's import system would (a regular package or a module file in the first folder that has
    one, else a plain folder: a namespace package). None for the built-in recipe, this project's own packages and
    modules that are only installed. A ConfigError when the module is found nowhere, or its submodule is missing
    below the top-level package found."""
    if recipe == BUILTIN_RECIPE:
        return None
    parts = _module_of(recipe)
    top = parts[0]
    if top in OWN_PACKAGES:
        return None
    where = ", ".join(str(p) for p in search) or "(no folder)"
    found = None
    for folder in search:
        package, module = Path(folder) / top, Path(folder) / f"{top}.py"
        if (package / "__init__.py").is_file():
            found = package
        elif module.is_file():
            found = module
        if found:
            break
    else:  # no regular package or module: a plain folder is a namespace package, unless one is installed
        found = next((Path(f) / top for f in search if (Path(f) / top).is_dir()), None)
        if found is not None and _installed(top, regular=True):
            return None
    if found is None:
        if _installed(top):
            return None
        raise ConfigError(
            f"recipe {recipe}: module {top!r} was found neither as a package folder {top}/ or a file {top}.py in "
            f"{where} nor among the installed packages; put the recipe's package next to the config file (or in "
            "its parent folder), or submit from the folder that holds it."
        )
    found = found.absolute()
    _check_trusted(recipe, found)
    if len(parts) > 1:
        if found.is_file():
            raise ConfigError(
                f"recipe {recipe}: {found} is a module file, not a package, so it has no submodule "
                f"{'.'.join(parts[1:])}; make {top} a package folder or fix the recipe's module path."
            )
        sub = found.joinpath(*parts[1:])
        if not (sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file()):
            raise ConfigError(
                f"recipe {recipe}: package {top} was found at {found} (searched {where}), but it has neither "
                f"{sub.with_suffix('.py')} nor {sub / '__init__.py'}; fix the recipe's module path."
            )
    return found


def _check_trusted(recipe: str, found: Path) -> None:
    """A recipe found beside a config or in its parent folder is code this user runs: refused when another user
    (root excepted) owns it or its folder, or anyone may write its folder without the sticky bit (a config kept in a
    shared folder must not pick up a package someone else put next to it). The submit folder is the user's choice."""
    if found.parent == Path.cwd().absolute():
        return
    for path in (found, found.parent):
        st = path.stat()
        if st.st_uid not in (os.geteuid(), 0) or (st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX):
            owner = user_name(st.st_uid)
            raise ConfigError(
                f"recipe {recipe}: {found} was found beside the config, but {path} belongs to {owner} or anyone may "
                "write it: the code snapshot takes only the user's own code from there. Submit from the folder "
                "that holds the recipe's package (it is searched too), or move it to a folder of your own."
            )


def _installed(top: str, *, regular: bool = False) -> bool:
    """Whether a top-level module is importable (``regular``: as a module or regular package, not a namespace
    package, which a plain folder on the import path also makes). Finding a top-level module's spec imports
    nothing."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    return not regular or spec.origin not in (None, "namespace")


def _files(source: Path, skip: Path | None, recipe: str = "") -> list[tuple[str, Path]]:
    """(path relative to the snapshot's root, file) of everything to copy from ``source``, sorted by path: no
    __pycache__, hidden files or folders, *.pyc; ``skip`` (the run directory, should it lie inside the package) left
    out. A link is followed only to what lies inside the package (one pointing out of it is a ConfigError: the
    snapshot is the recipe's own code); the sizes and the count are checked as the walk goes, so a package holding
    a data tree is refused before all of it is read."""
    if source.is_file():
        return _module_files(source, recipe)
    out: list[tuple[str, Path]] = []
    seen: set[Path] = set()
    inside = source.resolve()
    total = 0

    def walk(folder: Path, rel: str) -> None:
        nonlocal total
        real = folder.resolve()
        if real in seen or (skip is not None and (real == skip or skip in real.parents)):
            return
        seen.add(real)
        for entry in sorted(folder.iterdir(), key=lambda p: p.name):
            if entry.name.startswith(".") or entry.name == "__pycache__":
                continue
            target = entry.resolve()
            if entry.is_symlink() and target != inside and inside not in target.parents:
                raise ConfigError(
                    f"recipe {recipe}: {entry} links to {target}, outside the recipe's package {source}: the code "
                    "snapshot copies the package's own files only; copy what it needs into the package, or install it."
                )
            if entry.is_dir():
                walk(entry, f"{rel}/{entry.name}")
            elif entry.is_file() and not entry.name.endswith((".pyc", ".pyo")):
                size = entry.stat().st_size
                total += size
                out.append((f"{rel}/{entry.name}", entry))
                _check_size(recipe, entry, size, total, len(out), source)

    walk(source, source.name)
    return sorted(out)


def _module_files(source: Path, recipe: str) -> list[tuple[str, Path]]:
    """A single-file recipe and the other modules (``*.py`` files, not folders) of its folder: the ranks' import
    path does not hold the submit folder (they run with PYTHONSAFEPATH), so a module the recipe imports from beside
    it must come from the snapshot. A link among them must stay inside that folder."""
    out: list[tuple[str, Path]] = []
    total = 0
    folder = source.parent.resolve()
    for entry in sorted(source.parent.iterdir(), key=lambda p: p.name):
        if entry.name.startswith(".") or entry.suffix != ".py" or not entry.is_file():
            continue
        if entry.is_symlink() and entry.resolve().parent != folder:
            raise ConfigError(
                f"recipe {recipe}: {entry} links to {entry.resolve()}, outside the recipe's folder {source.parent}: "
                "the code snapshot copies the recipe's own modules only; copy the file there, or install it."
            )
        size = entry.stat().st_size
        total += size
        out.append((entry.name, entry))
        _check_size(recipe, entry, size, total, len(out), source.parent)
    return out


def _check_size(recipe: str, path: Path, size: int, total: int, count: int, source: Path | None = None) -> None:
    source = source or path
    if size > MAX_FILE_BYTES:
        raise ConfigError(
            f"recipe {recipe}: {path} is {size / 2**20:.1f} MB, over the {MAX_FILE_BYTES // 2**20} MB a file of the "
            f"code snapshot may have (the snapshot of {source} is code, not data); move data files out of the recipe's "
            "package and read them from a path given in recipe_args."
        )
    if total > MAX_TOTAL_BYTES or count > MAX_FILES:
        limit = f"{MAX_TOTAL_BYTES // 2**20} MB" if total > MAX_TOTAL_BYTES else f"{MAX_FILES} files"
        raise ConfigError(
            f"recipe {recipe}: the files of {source} add up to more than {limit} (at {path}); the code snapshot is "
            "code, not data: move data files out of the recipe's package."
        )


def _digest(files: list[tuple[str, Path]]) -> str:
    """SHA-256 over every file's relative path, size and bytes, in path order."""
    h = hashlib.sha256()
    for rel, path in sorted(files):
        h.update(f"{rel}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def take(rundir: RunDir, recipe: str, search: list[Path]) -> Snapshot | None:
    """Copy the recipe's top-level package (or module file) into ``RUN_DIR/code/`` with its manifest; None, and
    nothing written, when :func:`locate` finds nothing to copy. Written into a temporary folder and renamed into
    place, so a crash leaves the old snapshot or none, never a partial one."""
    source = locate(recipe, search)
    if source is None:
        return None
    files = _files(source, rundir.root.resolve(), recipe)
    tmp = rundir.root / f".code.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(mode=0o700, parents=True)
        os.chmod(tmp, 0o700)
        copied = []
        for rel, path in files:
            target = tmp / rel
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            copied.append((rel, target))
        snapshot = Snapshot(module=_module_of(recipe)[0], sha256=_digest(copied), source=str(source), files=len(copied))
        write_json_atomic(
            tmp / CODE_MANIFEST,
            {
                "module": snapshot.module,
                "sha256": snapshot.sha256,
                "source": snapshot.source,
                "files": snapshot.files,
                "taken_at": time.time(),
            },
        )
        _install(tmp, rundir.code)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            f"recipe {recipe}: the code snapshot of {source} cannot be written to {rundir.code}: "
            f"{exc.strerror or exc} ({exc.filename or tmp})."
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return snapshot


def _install(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` into ``final``; an old snapshot is moved aside first and removed after."""
    old = final.with_name(f".code.old-{os.getpid()}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def refresh(rundir: RunDir, recipe: str, search: list[Path]) -> Snapshot | None:
    """Take the snapshot again on purpose (``--refresh-code``): the old one is replaced only once the new one is
    complete. A ConfigError when the run has a snapshot but the recipe's module is no longer in ``search``."""
    snapshot = take(rundir, recipe, search)
    if snapshot is None and read(rundir) is not None:
        raise ConfigError(
            f"recipe {recipe}: its module is not in {', '.join(str(p) for p in search)}, so the code snapshot in "
            f"{rundir.code} cannot be refreshed; it is left as it was."
        )
    return snapshot


def read(rundir: RunDir) -> Snapshot | None:
    """The snapshot's manifest; None when the run has no snapshot."""
    path = rundir.code / CODE_MANIFEST
    try:
        data = json.loads(path.read_text())
        return Snapshot(
            module=str(data["module"]), sha256=str(data["sha256"]), source=str(data["source"]), files=int(data["files"])
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"the recipe's code snapshot manifest {path} cannot be read ({exc}).") from None


def _snapshot_files(rundir: RunDir, module: str) -> list[tuple[str, Path]]:
    """What the snapshot holds: the package's files, or the single module's and its sibling modules' files."""
    folder, single = rundir.code / module, rundir.code / f"{module}.py"
    if folder.is_dir():
        return _files(folder, None)
    if single.is_file():
        return [(p.name, p) for p in sorted(rundir.code.iterdir()) if p.suffix == ".py" and p.is_file()]
    return []


def activate(rundir: RunDir) -> str | None:
    """Trainer side, each launch: verify the snapshot against its manifest and put ``RUN_DIR/code`` first on
    ``sys.path`` (once); its sha256, or None when the run has no snapshot."""
    snapshot = read(rundir)
    if snapshot is None:
        return None
    files = _snapshot_files(rundir, snapshot.module)
    actual = _digest(files) if files else "missing"
    if actual != snapshot.sha256:
        raise ConfigError(
            f"the recipe's code snapshot in {rundir.code} was changed after submit (sha256 {actual} expected "
            f"{snapshot.sha256}); a job runs the code that was submitted: restore it, or take a new snapshot with "
            f"python -m hpc resume {rundir.root} --refresh-code."
        )
    entry = str(rundir.code.absolute())
    if not sys.path or sys.path[0] != entry:
        while entry in sys.path:
            sys.path.remove(entry)
        sys.path.insert(0, entry)
        importlib.invalidate_caches()
    return snapshot.sha256
