"""Gang preflight: a short check of every rank before step 0 of every launch (``monitor.preflight``).

Each rank measures itself (``measure``): its device and free memory, a compute probe (small matmuls), the
all-reduce on its intra-node group and on its inter-node group (latency: one element; bandwidth:
``monitor.preflight_mib``, bus bandwidth as nccl-tests counts it), a ping-pong with its neighbours on a ring of the
nodes (3+ nodes), and a read of the first train item it will read (any map-style dataset). Every timed figure is the
best of a few tries: a slow device or link is slow every time, a rank that lost its core once on a shared host is
not. One all-gather of the figures; then every rank runs the same pure decision (``judge``, in preflight_verdict.py),
so all of them act alike without a further collective.

A node is named when its intra-node bandwidth, best link, compute or free memory is below the median of the *other*
nodes by more than ``monitor.preflight_margin``, or when one of its ranks cannot read its data. Every node unable to
read means the data is at fault, not a node: that is reported, and the first step's read then fails the way the loader
classifies it (bad input, or a storage fault that outlived its retries). The inter-node all-reduce is reported but names
nobody: it spans every node, so all its members time the same operation. The ring ping-pong does: a node's best link is
slow only when the node itself is. A first verdict that names a node has the ranks measure once more (``better_of``).
Rank 0 logs a table and appends one ``preflight`` history event, which says how many times the ranks measured.
With ``exclude`` a named node ends the launch: rank 0 writes failure.json with the node's ranks as suspects (the
launcher leaves the node out) and every rank returns EXIT_FAILED through the normal teardown.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from mpi4py import MPI

from rundir import RunDir
from rundir.contract import EVENT_PREFLIGHT, FAILURE_PREFLIGHT, append_event
from trainer.data.loader import BatchLoader
from trainer.env import RuntimeEnv, patient_allgather
from trainer.errors import first_line
from trainer.loop.parts import Parts
from trainer.observe.inject import Injector
from trainer.observe.preflight_verdict import Verdict, better_of, fmt, judge, rounded
from trainer.parallel.comm import HierGroups
from trainer.parallel.topology import Topology

log = logging.getLogger(__name__)
# Timed repetitions, after one untimed warm-up; the best one counts. The same on every rank (collectives).
TRIES = 8  # bandwidth: all-reduce and ping-pong of monitor.preflight_mib
LATENCY_TRIES = 5  # one-element all-reduce
COMPUTE_TRIES = 5
AUTO_MIB = {"cuda": 64.0, "cpu": 4.0}  # monitor.preflight_mib 0: enough to be bandwidth-bound on the device's links


# -- measuring (every rank) ---------------------------------------------------------------------------------------
def measure(
    env: RuntimeEnv,
    device: torch.device,
    groups: HierGroups,
    loader: BatchLoader,
    *,
    position: int,
    mib: float,
    injector: Injector,
) -> dict:
    """This rank's figures (collective over its groups: every rank calls it). ``position``: the stream position of
    the first step this launch trains (its first item is read)."""
    start = time.perf_counter()
    topo = env.topology
    figures: dict = {"rank": env.rank, **device_figures(device, env.cpus)}
    figures["data_read_s"], figures["data_error"] = read_first_item(loader, position)
    nbytes = max(4, int(mib * 2**20) // 4 * 4)
    slow = injector.before_preflight_collective
    # Phases start together (ranks arrive from start-up at different times): no rank times a collective while
    # another one on its host still runs the compute probe (simulated nodes share the cores).
    line_up = _barrier(device)
    line_up()
    figures["compute_gflops"] = compute_gflops(device)
    line_up()
    turns = host_turns(env.hosts, topo)  # nodes sharing a host take turns: each is timed without the other's load
    for turn in range(max(turns) + 1):
        if turn == turns[env.node] and topo.ranks_per_node > 1:
            figures["intra_gbps"], figures["intra_latency_us"] = allreduce_figures(groups.intra, device, nbytes, slow)
        line_up()
    if topo.num_nodes > 1:
        figures["inter_gbps"], figures["inter_latency_us"] = allreduce_figures(groups.inter, device, nbytes, slow)
    figures["links"] = ring_links(env, device, nbytes, slow)
    figures["seconds"] = time.perf_counter() - start
    return figures


def device_figures(device: torch.device, cpus: int) -> dict:
    """The device's name and memory (free and total, GB): CUDA's own figures, else the host's MemAvailable."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"device": torch.cuda.get_device_name(device), "mem_free_gb": free / 1e9, "mem_total_gb": total / 1e9}
    info = _proc_fields("/proc/meminfo")
    kb = {k: int(v.split()[0]) for k, v in info.items() if k in ("MemAvailable", "MemTotal") and v.split()}
    model = _proc_fields("/proc/cpuinfo").get("model name", "")
    return {
        "device": f"cpu{' ' + model if model else ''} ({cpus} cores)",
        "cores": cpus,
        "mem_free_gb": kb["MemAvailable"] * 1024 / 1e9 if "MemAvailable" in kb else None,
        "mem_total_gb": kb["MemTotal"] * 1024 / 1e9 if "MemTotal" in kb else None,
    }


def compute_gflops(device: torch.device) -> float:
    """Matmul throughput, GFLOP/s: the best of a few tries of a few square matmuls (bf16 4096 on GPU, fp32 256 on
    CPU). Fixed inputs: the global random streams are left as they are."""
    n, dtype, per_try = (4096, torch.bfloat16, 8) if device.type == "cuda" else (256, torch.float32, 2)
    a = torch.full((n, n), 0.5, dtype=dtype, device=device)
    out = torch.empty_like(a)

    def matmuls() -> None:
        for _ in range(per_try):
            torch.mm(a, a, out=out)

    return per_try * 2 * n**3 / best_time(matmuls, device, COMPUTE_TRIES) / 1e9


def read_first_item(loader: BatchLoader, position: int) -> tuple[float | None, str | None]:
    """(seconds, None) to read the first item this rank trains on, or (None, what went wrong)."""
    index = None
    start = time.perf_counter()
    try:
        index = int(loader.ids(position, 0)[0])
        loader.dataset[index]
    except Exception as exc:  # the user's dataset: any error is reported with where it happened
        return None, f"{loader.what}[{index}] raised {first_line(exc)}"
    return time.perf_counter() - start, None


def allreduce_figures(
    group: dist.ProcessGroup, device: torch.device, nbytes: int, before: Callable[[], None]
) -> tuple[float, float]:
    """(bus bandwidth GB/s of an all-reduce of ``nbytes``, latency in microseconds of a one-element all-reduce)."""
    size = dist.get_world_size(group)
    big = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    small = torch.zeros(1, dtype=torch.float32, device=device)
    before()
    dist.all_reduce(big, group=group)  # warm-up (connections, buffers of this size); it also lines the group up
    latency = best_time(lambda: dist.all_reduce(small, group=group), device, LATENCY_TRIES, before, warm=False)
    seconds = best_time(lambda: dist.all_reduce(big, group=group), device, TRIES, before, warm=False)
    return nbytes / seconds * 2 * (size - 1) / size / 1e9, latency * 1e6


def host_turns(hosts: tuple[str, ...], topo: Topology) -> list[int]:
    """Per node, its turn for the intra-node measurement: 0 for the first node on its host, 1 for the second...
    All 0 where every node has its own host (a real cluster); simulated nodes share one host's cores."""
    seen: dict[str, int] = {}
    turns = []
    for n in range(topo.num_nodes):
        host = hosts[topo.node_ranks(n)[0]]
        turns.append(seen.get(host, 0))
        seen[host] = turns[-1] + 1
    return turns


def ring_rounds(num_nodes: int) -> list[list[tuple[int, int]]]:
    """The node ring's neighbour pairs (k, k+1 mod N) in rounds where each node is in at most one pair. None below 3
    nodes: two nodes have one link between them, whose figure cannot say which end is slow."""
    if num_nodes < 3:
        return []
    pairs = [(k, (k + 1) % num_nodes) for k in range(num_nodes)]
    rounds = [pairs[0 : num_nodes - 1 : 2], pairs[1:num_nodes:2]]
    if num_nodes % 2:
        rounds.append([pairs[-1]])  # (N-1, 0) shares node 0 with the first pair
    return rounds


def ring_links(env: RuntimeEnv, device: torch.device, nbytes: int, before: Callable[[], None]) -> dict[int, float]:
    """Neighbour node -> GB/s of a ping-pong of ``nbytes`` with the rank of the same local index there."""
    topo = env.topology
    out: dict[int, float] = {}
    buf = None
    for pairs in ring_rounds(topo.num_nodes):
        for a, b in pairs:
            if env.node not in (a, b):
                continue
            other = b if env.node == a else a
            if buf is None:
                buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
            pingpong = _pingpong(buf, topo.node_ranks(other)[env.local_rank], first=env.node == a)
            out[other] = 2 * nbytes / best_time(pingpong, device, TRIES, before) / 1e9
    return out


def _pingpong(buf: torch.Tensor, peer: int, *, first: bool) -> Callable[[], None]:
    def run() -> None:
        if first:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)

    return run


def best_time(
    op: Callable[[], object],
    device: torch.device,
    tries: int,
    before: Callable[[], None] | None = None,
    *,
    warm: bool = True,
) -> float:
    """The shortest of ``tries`` timed runs of ``op`` (after one untimed warm-up, which also lines up the ranks of a
    collective); ``before`` runs inside each timed run (injected faults)."""
    if warm:
        if before is not None:
            before()
        op()
    best = math.inf
    for _ in range(tries):
        _sync(device)
        start = time.perf_counter()
        if before is not None:
            before()
        op()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _barrier(device: torch.device) -> Callable[[], None]:
    """A barrier of every rank: a one-element all-reduce on the default group (on the device: NCCL too)."""
    token = torch.zeros(1, dtype=torch.float32, device=device)
    return lambda: dist.all_reduce(token)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _proc_fields(path: str) -> dict[str, str]:
    """'key: value' lines of a /proc file (first occurrence of each key); {} where it cannot be read."""
    out: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    out.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return out


# -- the launch's preflight ----------------------------------------------------------------------------------------
def run_preflight(parts: Parts, comm: MPI.Comm, rundir: RunDir) -> bool:
    """Collective: measure, gather, judge, report (rank 0). False when a node is named and monitor.preflight is
    exclude: failure.json is written and every rank ends the launch with EXIT_FAILED."""
    cfg, env = parts.cfg.monitor, parts.env
    if cfg.preflight in ("off", False):  # False: YAML's reading of a bare off
        return True
    start = time.perf_counter()
    parts.mon.watchdog.enter("preflight")
    mib = cfg.preflight_mib or AUTO_MIB.get(parts.distributed.device.type, AUTO_MIB["cpu"])

    def measure_once() -> dict:
        return measure(
            env,
            parts.distributed.device,
            parts.distributed.groups,
            parts.loader,
            position=parts.state.data_position,
            mib=mib,
            injector=parts.mon.injector,
        )

    mine = measure_once()
    # The nodes finish measuring at different times; ranks spinning in MPI's gather would starve the gloo transfers
    # the others are still finishing on a shared host.
    figures = patient_allgather(comm, mine)
    verdict = judge(figures, ranks_per_node=env.topology.ranks_per_node, margin=cfg.preflight_margin)
    measured = 1
    # A first verdict that names a node is a question, not an answer: every rank measures once more and each rank's
    # better figure of the two counts, so a node is named only when it is slow both times.
    if verdict.named:  # every rank judged the same figures: all of them measure again, or none
        again = measure_once()
        figures = patient_allgather(comm, better_of(mine, again))
        verdict = judge(figures, ranks_per_node=env.topology.ranks_per_node, margin=cfg.preflight_margin)
        measured = 2
    seconds = time.perf_counter() - start
    exclude = cfg.preflight == "exclude" and bool(verdict.named)
    if env.rank == 0:
        _report(parts, rundir, verdict, seconds, exclude, mib, measured)
    return not exclude


def _report(
    parts: Parts, rundir: RunDir, verdict: Verdict, seconds: float, exclude: bool, mib: float, measured: int
) -> None:
    """Rank 0: the table in the log, the history event, the warnings or failure.json."""
    cfg, env = parts.cfg.monitor, parts.env
    _log_table(parts, verdict, seconds, measured)
    action = None if not verdict.named else "exclude" if exclude else "warn"
    append_event(
        rundir.history,
        EVENT_PREFLIGHT,
        launch=env.launch_id,
        mode=cfg.preflight,
        seconds=round(seconds, 3),
        margin=cfg.preflight_margin,
        mib=mib,
        measured=measured,
        nodes=[{**rounded(row), "name": _node_name(env, row["node"])} for row in verdict.nodes],
        links=[rounded(link) for link in verdict.links],
        named=[{"node": n, "name": _node_name(env, n), "why": "; ".join(w)} for n, w in verdict.named.items()],
        action=action,
        unreadable=verdict.unreadable,
        skipped=verdict.skipped,
    )
    _act(env, rundir, verdict, exclude)


def _node_name(env: RuntimeEnv, node: int) -> str:
    return env.node_names[env.topology.node_ranks(node)[0]]


def _log_table(parts: Parts, verdict: Verdict, seconds: float, measured: int) -> None:
    """Rank 0: the preflight's summary line and one line per node."""
    cfg, env, topo = parts.cfg.monitor, parts.env, parts.env.topology
    log.info(
        "preflight took %.2f s (slowest rank measuring: %.2f s%s); %d node(s) x %d rank(s), monitor.preflight=%s%s",
        seconds,
        max(row["seconds"] for row in verdict.nodes),
        ", twice: the first measurement named a node" if measured == 2 else "",
        topo.num_nodes,
        topo.ranks_per_node,
        cfg.preflight,
        "".join(f"; skipped {s}" for s in verdict.skipped),
    )
    for row in verdict.nodes:
        read = "-" if row["data_read_s"] is None else f"{row['data_read_s'] * 1e3:.3g} ms"
        log.info(
            "preflight node %d (%s): %s, %s of %s free, compute %s, intra-node %s %s, inter-node %s %s, best link "
            "%s, first item read in %s",
            row["node"], _node_name(env, row["node"]), row["device"], fmt(row["mem_free_gb"]),
            fmt(row["mem_total_gb"], "GB"), fmt(row["compute_gflops"], "GFLOP/s"), fmt(row["intra_gbps"], "GB/s"),
            fmt(row["intra_latency_us"], "us"), fmt(row["inter_gbps"], "GB/s"), fmt(row["inter_latency_us"], "us"),
            fmt(row["link_gbps"], "GB/s"), read,
        )  # fmt: skip


def _act(env: RuntimeEnv, rundir: RunDir, verdict: Verdict, exclude: bool) -> None:
    """Rank 0: warn about unreadable data and named nodes, or (``exclude``) write failure.json naming their ranks."""
    if verdict.unreadable is not None:
        log.warning(
            "preflight: the data is unreadable on every node (%s); the first step will fail", verdict.unreadable
        )
    if not verdict.named:
        return
    findings = [f"node {n} ({_node_name(env, n)}): {'; '.join(whys)}" for n, whys in verdict.named.items()]
    if not exclude:
        for finding in findings:
            log.warning("preflight: %s; training goes on (monitor.preflight: warn)", finding)
        return
    message = (
        f"preflight: {' | '.join(findings)}. The launch ends so that the launcher can leave the node(s) out "
        "(monitor.preflight: exclude)."
    )
    log.error("%s", message)
    suspects = [
        env.suspect(rank, f"preflight: {'; '.join(whys)}")
        for n, whys in verdict.named.items()
        for rank in env.topology.node_ranks(n)
    ]
    rundir.write_failure(0, message, FAILURE_PREFLIGHT, suspects=suspects)
