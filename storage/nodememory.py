"""Where a run's checkpoints in node memory live (checkpoint.memory_every_steps) and their removal by the launcher
once the run ends (torch-free: the launchers and ``python -m hpc.shmsweep`` use it on login and batch nodes)."""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

RUN_ID_RE = re.compile(r"[0-9a-f]{32}")  # rundir/identity.py's run ids


def run_folder(memory_dir: str | Path, run_id: str) -> Path:
    """The run's folder of node folders, ``MEMORY_DIR/hpc-UID/RUN_ID`` (the same path on every node; one host holds
    every node's folder when nodes are simulated)."""
    return Path(memory_dir) / f"hpc-{os.geteuid()}" / run_id


def node_label(name: str) -> str:
    """A node's folder name: its name, never a path."""
    return name.replace("/", "_").lstrip(".") or "node"


def remove_run(memory_dir: str | Path, run_id: str) -> bool:
    """The run's node folders on this host removed; whether there were any. Only this user's own folder (no link)
    is touched, and only for a well-formed run id."""
    if not RUN_ID_RE.fullmatch(run_id):
        return False
    root = run_folder(memory_dir, run_id)
    try:
        st = os.lstat(root)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False
    shutil.rmtree(root, ignore_errors=True)
    return True
