"""What the benchmark scripts share: starting themselves under the pip-installed MPI's mpirun, measuring (and
waiting out) the load other processes put on the machine, and following a run from outside (commands, JSON-lines
files, waiting for a condition)."""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
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


def sh(*args: str, **kw) -> str:
    """Run a command; its stdout (an error if it fails)."""
    return subprocess.run(args, capture_output=True, text=True, check=True, **kw).stdout


def lines(path: Path) -> list[dict]:
    """The records of a JSON-lines file of a run directory; [] while it is missing or half-written."""
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (FileNotFoundError, ValueError):
        return []


def wait(predicate, timeout: float = 180.0, every: float = 0.1):
    """Poll ``predicate`` until it returns something true; that value (TimeoutError after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError("timed out")
