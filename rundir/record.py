"""The record of a run in RUN_DIR/record/: what a submission was (``submit-NNN.json``: the command line, where and
by whom, the recipe's project repository with its commit and uncommitted diff) and what each launch ran on
(``launch-ID.json``, written by the trainer: trainer/observe/record.py). Torch-free: the submit side runs on login
nodes.

Environment variables are recorded where their names start with a prefix that changes how the job behaves
(``RECORDED_PREFIXES``), never when the name or the value looks like a credential (runconfig/secrets.py)."""

from __future__ import annotations

import getpass
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from runconfig.secrets import key_is_secret, value_secret
from storage.files import write_json_atomic

RECORDED_PREFIXES = (
    "NCCL_", "UCX_", "OMP_", "CUDA_", "SLURM_", "HPC_", "FI_", "MPICH_", "OMPI_", "PMIX_", "I_MPI_", "TORCH_",
    "PYTORCH_", "GLOO_", "MKL_", "KMP_",
)  # fmt: skip
#: Any name with one of these in it is left out, whatever else it says (NCCL_IB_KEY, HPC_X_TOKEN_FILE, ...).
CREDENTIAL_NAMES = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.I)
DIFF_LIMIT = 4 << 20  # bytes of a project's uncommitted diff kept in the record


def recorded_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that change behaviour, without any that looks like a credential."""
    out = {}
    for name, value in sorted(environ.items()):
        if not name.startswith(RECORDED_PREFIXES):
            continue
        if key_is_secret(name) or CREDENTIAL_NAMES.search(name) or value_secret(value):
            continue
        out[name] = value
    return out


def _git(folder: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def project_repository(source: str | Path | None) -> tuple[dict | None, str]:
    """(facts, diff) of the git checkout holding ``source`` (the recipe's code as the snapshot found it): its root,
    commit, branch, whether it is dirty and which files are untracked; the diff of its uncommitted changes against
    HEAD. (None, "") where ``source`` is in no checkout (or git is missing)."""
    if source is None:
        return None, ""
    folder = Path(source) if Path(source).is_dir() else Path(source).parent
    top = _git(folder, "rev-parse", "--show-toplevel")
    if top is None:
        return None, ""
    root = Path(top.strip())  # paths below are the root's
    # Changes and diff of the project's own folder only: the rest of a checkout (another project's work, files with
    # secrets) is none of the run's record.
    project = os.path.relpath(folder.resolve(), root.resolve())
    status = (_git(root, "status", "--porcelain=v2", "--branch", "--", project) or "").splitlines()
    head = dict(line[2:].split(" ", 1) for line in status if line.startswith("# branch.") and " " in line[2:])
    commit = head.get("branch.oid") if head.get("branch.oid") != "(initial)" else None
    changes = [line for line in status if not line.startswith("#")]
    diff = (_git(root, "diff", "HEAD", "--no-color", "--", project) or "") if commit else ""
    facts = {
        "root": str(root),
        "project": project,
        "commit": commit,
        "branch": head.get("branch.head") if head.get("branch.head") != "(detached)" else None,
        "dirty": bool(changes),
        "untracked": [line[2:] for line in changes if line.startswith("? ")][:200],
        "diff_bytes": len(diff.encode()),
    }
    if len(diff.encode()) > DIFF_LIMIT:
        diff = diff.encode()[:DIFF_LIMIT].decode(errors="ignore") + f"\n[diff cut at {DIFF_LIMIT} bytes]\n"
    return facts, diff


def next_number(folder: Path, prefix: str) -> int:
    """The number after the highest ``prefix``-NNN.json in ``folder`` (0 in an empty one)."""
    pattern = re.compile(rf"{prefix}-(\d+)\.json$")
    taken = [int(m.group(1)) for p in folder.glob(f"{prefix}-*.json") if (m := pattern.fullmatch(p.name))]
    return max(taken, default=-1) + 1


def write_json(path: Path, data: dict) -> None:
    """Written under a temporary name and renamed: a reader never sees half a record."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    write_json_atomic(path, data, fsync=False, indent=1, sort_keys=True, default=str)


def command_line(module: str, argv: list[str]) -> str:
    return shlex.join([sys.executable, "-m", module, *argv])


def write_submission(folder: Path, command: str, *, resumed: bool, project_source: str | None) -> Path:
    """``folder``/submit-NNN.json (and submit-NNN.diff when the project has uncommitted changes); its path.
    ``project_source``: where the code snapshot was taken from now (None: a resume that keeps its snapshot)."""
    number = next_number(folder, "submit")
    project, diff = project_repository(project_source)
    record = {
        "time": time.time(),
        "command": command,
        "cwd": os.getcwd(),
        "user": _user(),
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "resumed": resumed,
        "project_source": project_source,
        "project": project,
        "environment": recorded_environment(os.environ),
    }
    if diff:  # before the record that announces it
        folder.mkdir(mode=0o700, exist_ok=True)
        (folder / f"submit-{number:03d}.diff").write_text(diff)
    path = folder / f"submit-{number:03d}.json"
    write_json(path, record)
    return path


def _user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None
