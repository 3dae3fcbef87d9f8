"""Where a run's code and libraries came from: recorded in checkpoint manifests."""

from __future__ import annotations

import functools
import platform
import subprocess
from importlib import metadata
from pathlib import Path


@functools.cache
def git_commit() -> str | None:
    """The commit of the checkout the trainer runs from, if it is one (dirty trees get a '+dirty' suffix)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


@functools.cache
def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "mpi4py", "h5py", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
