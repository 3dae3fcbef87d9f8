"""What the benchmark scripts share: starting themselves under the pip-installed MPI's mpirun."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mpirun_and_env(*, per_node: int, threads: int) -> tuple[Path, dict[str, str]] | None:
    """The mpirun beside this Python and the workers' environment (repo importable, nodes of ``per_node``
    simulated on one host, ``threads`` OpenMP threads); None, after an error message, without an mpirun."""
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        print(f"error: no mpirun beside {sys.executable}", file=sys.stderr)
        return None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["HPC_SIMULATE_RANKS_PER_NODE"] = str(per_node)
    env["OMP_NUM_THREADS"] = str(threads)
    return mpirun, env
