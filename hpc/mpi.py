"""Finding the pip-installed MPI launcher and the flags its flavour needs (torch-free)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


class LauncherError(Exception):
    pass


@dataclass(frozen=True)
class MpiLauncher:
    path: str
    flavour: str  # "mpich" | "openmpi"

    def command(self, nprocs: int, program: list[str], wraps: list[list[str]] | None = None) -> list[str]:
        """``nprocs`` ranks of ``program``; with ``wraps`` (one command prefix per node of nprocs / len(wraps)
        consecutive ranks), one MPMD segment per node, its ranks run under its prefix."""
        args = [self.path]
        if self.flavour == "mpich":
            # The launcher ends a launch whose rank died (hpc/ranks.py), after the survivors had time to name it.
            args.append("-disable-auto-cleanup")
        if self.flavour == "openmpi":
            args += ["--oversubscribe", "--bind-to", "none"]
            if os.geteuid() == 0:
                args.append("--allow-run-as-root")
        if not wraps:
            return [*args, "-n", str(nprocs), *program]
        per_node = nprocs // len(wraps)
        for i, wrap in enumerate(wraps):
            args += [":"] if i else []
            args += ["-n", str(per_node), *wrap, *program]
        return args


def find_launcher() -> MpiLauncher:
    """``mpirun`` beside this Python (the venv's pip-installed MPI) first, then on PATH."""
    here = Path(sys.executable).parent
    for candidate in (here / "mpirun", here / "mpiexec"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            path = str(candidate)
            break
    else:
        path = shutil.which("mpirun") or shutil.which("mpiexec")
    if not path:
        raise LauncherError(
            "no mpirun found beside this Python or on PATH: install an MPI, e.g. `pip install mpich mpi4py` "
            "(see envs/requirements-cpu.txt)."
        )
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LauncherError(f"{path} --version failed: {exc}") from None
    flavour = "openmpi" if ("Open MPI" in text or "OpenRTE" in text or "prte" in text.lower()) else "mpich"
    return MpiLauncher(path=path, flavour=flavour)
