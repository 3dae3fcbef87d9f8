"""What the benchmark scripts share: their command line's common options and their output (a table, then the JSON
object, which ``--json PATH`` also writes to a file), starting themselves under the pip-installed MPI's mpirun,
measuring (and waiting out) the load other processes put on the machine, and following a run from outside
(commands, JSON-lines files, waiting for a condition)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The project's packages first: a script run as ``python bench/NAME.py`` has bench/ as sys.path[0], where a
# benchmark named like a package would shadow it.
if sys.path[0] != str(ROOT):
    sys.path.insert(0, str(ROOT))
OTHER_LOAD_LIMIT = 0.1  # cores used by other processes during a run above which its figures are suspect
QUIET_WAIT_S = 60.0  # wait_for_quiet's default cap, seconds (set_quiet_wait: a script's --quiet-wait-s)
LINK_IFNAME = "ic0"  # both veth ends of an emulated link carry this name: one GLOO_SOCKET_IFNAME fits every rank
LINK_IPS = ("10.213.7.1", "10.213.7.2")
JSON_HELP = "also write the benchmark's JSON object to this file"


def bench_parser(doc: str, *, quiet_wait: bool = False, prog: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser: described by the first line of its docstring ``doc``, with ``--json PATH`` and, for the
    scripts that wait for a quiet machine before each run, ``--quiet-wait-s`` (apply it with set_quiet_wait)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    p.add_argument("--json", type=Path, metavar="PATH", help=JSON_HELP)
    if quiet_wait:
        add_quiet_wait_option(p)
    return p


def add_quiet_wait_option(p: argparse.ArgumentParser) -> None:
    """The ``--quiet-wait-s`` option of the scripts that wait for a quiet machine before each run (set_quiet_wait)."""
    p.add_argument(
        "--quiet-wait-s",
        type=float,
        default=QUIET_WAIT_S,
        help=f"before each run, wait at most this long for other processes to go quiet (default {QUIET_WAIT_S:g}; "
        "0: do not wait, e.g. a smoke test on a busy machine)",
    )


def add_nodes_ranks(p: argparse.ArgumentParser, *, nodes: int, ranks: int) -> None:
    """``--nodes`` (nodes simulated on this host) and ``--ranks`` (ranks per node), with these defaults."""
    p.add_argument("--nodes", type=int, default=nodes, help=f"simulated nodes (default {nodes})")
    p.add_argument("--ranks", type=int, default=ranks, help=f"ranks per node (default {ranks})")


def add_run_length(p: argparse.ArgumentParser, *, steps: int, skip: int, rounds: int, of: str) -> None:
    """``--steps`` (optimizer steps per run), ``--skip`` (warm-up steps left out of every run) and ``--rounds``
    (rounds of every ``of``: each round runs each once); check_run_length checks them."""
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps per run (default {steps})")
    p.add_argument("--skip", type=int, default=skip, help=f"warm-up steps left out of every run (default {skip})")
    p.add_argument("--rounds", type=int, default=rounds, help=f"rounds of every {of} (default {rounds})")


def check_run_length(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The parser's error unless every run keeps steps after its warm-up."""
    if args.steps <= args.skip:
        p.error("--steps must be larger than --skip")


def write_json(path: Path, result: object) -> None:
    """``result`` as the JSON file of ``--json PATH``."""
    path.write_text(json.dumps(result, indent=2) + "\n")


def emit(result: dict, json_path: Path | None, show: Callable[[dict], None] | None = None) -> None:
    """How every benchmark ends: its table (``show(result)``; None where the table was printed as the runs went),
    then the JSON object on stdout, and with ``--json PATH`` the same object in that file."""
    if show is not None:
        show(result)
    print("\n" + json.dumps(result, indent=2), flush=True)
    if json_path is not None:
        write_json(json_path, result)


def _ip(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


@contextlib.contextmanager
def emulated_link(mbit: float) -> Iterator[tuple[str, str]]:
    """Two network namespaces (two emulated nodes, root only) joined by a veth pair named ``ic0`` at both ends,
    with addresses LINK_IPS, shaped by tbf on both ends to ``mbit`` (this kernel has no netem). Ranks in one
    namespace reach each other over its own address, unshaped; across, over the shaped link. Torn down on every
    path."""
    names = (f"arbench{os.getpid()}a", f"arbench{os.getpid()}b")
    rate_bytes = mbit * 1e6 / 8
    burst = max(64 << 10, int(rate_bytes / 250))  # enough tokens for a 4 ms timer tick at this rate
    try:
        for ns in names:
            _ip("ip", "netns", "add", ns)
        peer = ("peer", "name", LINK_IFNAME, "netns", names[1])
        _ip("ip", "link", "add", LINK_IFNAME, "netns", names[0], "type", "veth", *peer)
        for ns, ip in zip(names, LINK_IPS, strict=True):
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
            _ip("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", LINK_IFNAME)
            _ip("ip", "-n", ns, "link", "set", LINK_IFNAME, "up")
            shape = ("rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "50ms")
            _ip("tc", "-n", ns, "qdisc", "add", "dev", LINK_IFNAME, "root", "tbf", *shape)
        yield names
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # deleting one end removes the pair


@contextlib.contextmanager
def slurm_cluster(ports: dict[str, str], slurm_conf: Path | None = None) -> Iterator[Path]:
    """The Slurm cluster a benchmark submits to, SLURM_CONF pointing at it for the duration: by default its own
    (envs/slurm/cluster.sh on ``ports``, apart from a developer's and the tests' clusters, in a fresh state folder,
    wiped afterwards); with ``slurm_conf`` (a script's ``--slurm-conf``) the running cluster of that file, neither
    started nor stopped (e.g. the test session's: one of cluster.sh's, which has the ``urgent`` partition). Yields
    the cluster's state folder (cluster.sh's; the folder of ``slurm_conf``)."""
    if slurm_conf is not None:
        if not slurm_conf.is_file():
            raise SystemExit(f"error: --slurm-conf {slurm_conf}: no such file")
        os.environ["SLURM_CONF"] = str(slurm_conf.resolve())
        yield slurm_conf.resolve().parent
        return
    state = Path(tempfile.mkdtemp(prefix="hpc-slurm-bench-", dir="/tmp"))
    state.chmod(0o755)  # the munge user must traverse it
    env = {"HPC_SLURM_FIRST_JOB_ID": "900001", **os.environ, **ports}  # apart from a test session's job ids
    sh("bash", "envs/slurm/cluster.sh", "install", cwd=ROOT, env=env)
    try:
        sh("bash", "envs/slurm/cluster.sh", "start", str(state), cwd=ROOT, env=env)
        os.environ["SLURM_CONF"] = str(state / "slurm.conf")
        yield state
    finally:
        subprocess.run(["bash", "envs/slurm/cluster.sh", "wipe", str(state)], cwd=ROOT, env=env, capture_output=True)


def add_slurm_options(p, methods: tuple[str, ...]) -> None:
    """``--methods`` (a subset of ``methods``) and ``--slurm-conf FILE`` (a running cluster, slurm_cluster)."""
    p.add_argument("--methods", default=",".join(methods), help=f"comma-separated subset of {','.join(methods)}")
    p.add_argument(
        "--slurm-conf",
        type=Path,
        metavar="FILE",
        help="use the running cluster of this slurm.conf (one of envs/slurm/cluster.sh's) instead of starting one",
    )


def chosen_methods(p, text: str, methods: tuple[str, ...]) -> list[str]:
    """``--methods``' list, in the order given; a name outside ``methods`` (or none) is the parser's error."""
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    if not chosen or set(chosen) - set(methods):
        p.error(f"--methods takes a comma-separated subset of {','.join(methods)}")
    return chosen


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


def _stat_after_comm(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the ``(comm)`` one (the name may hold spaces): [state, ppid, ...]."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it now, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat_after_comm(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system, every thread) that the processes ``pids`` have used so far; a gone one adds 0."""
    ticks = 0
    for pid in pids:
        try:
            fields = _stat_after_comm(pid)
            ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
        except (OSError, ValueError, IndexError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def set_quiet_wait(seconds: float) -> None:
    """wait_for_quiet's cap from now on (a script's ``--quiet-wait-s``)."""
    global QUIET_WAIT_S
    QUIET_WAIT_S = max(0.0, seconds)


def wait_for_quiet(max_wait_s: float | None = None) -> None:
    """Wait (at most ``max_wait_s``, default QUIET_WAIT_S) until other processes use less than OTHER_LOAD_LIMIT
    cores for a second."""
    deadline = time.monotonic() + (QUIET_WAIT_S if max_wait_s is None else max_wait_s)
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
