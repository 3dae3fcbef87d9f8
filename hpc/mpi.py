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

    def command(self, nprocs: int, program: list[str]) -> list[str]:
        args = [self.path, "-n", str(nprocs)]
        if self.flavour == "mpich":
            # The launcher ends a launch whose rank died (hpc/ranks.py), after the survivors had time to name it.
            args.append("-disable-auto-cleanup")
        if self.flavour == "openmpi":
            args += ["--oversubscribe", "--bind-to", "none"]
            if os.geteuid() == 0:
                args.append("--allow-run-as-root")
        return args + program


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
