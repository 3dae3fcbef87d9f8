"""What the benchmark scripts share: starting themselves under the pip-installed MPI's mpirun, and measuring (and
waiting out) the load other processes put on the machine."""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OTHER_LOAD_LIMIT = 0.1  # cores used by other processes during a run above which its figures are suspect


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


def busy_cpu_s() -> float:
    """CPU seconds used by every process on this machine since boot (/proc/stat); nan where unknown."""
    try:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    except (OSError, ValueError):
        return math.nan
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds used by this process's finished children and their descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_quiet(max_wait_s: float = 60.0) -> None:
    """Wait (at most ``max_wait_s``) until other processes use less than OTHER_LOAD_LIMIT cores for a second."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        before = busy_cpu_s()
        time.sleep(1.0)
        if not busy_cpu_s() - before > OTHER_LOAD_LIMIT:  # also true when /proc/stat is unreadable (nan)
            return
