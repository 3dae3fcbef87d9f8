"""``comm.allreduce: auto``: time flat and each hierarchical variant on the run's own process groups for the
bucket sizes DDP uses, and pick the fastest per size (Horovod's autotuner is the model; on a GPU cluster NCCL's
own tree and NVLS algorithms may make flat the winner, and then flat is chosen).

Collective: every rank runs the same calls in the same order. Per size, each algorithm runs a batch of
``batch_calls(size)`` back-to-back calls (as DDP issues its buckets); a batch's time per call is the slowest
rank's (one all-reduce MAX per round), and an algorithm's figure is its best round, so every rank computes the same
figures and the same choices. Back-to-back batches amortize the ranks' skew at a batch's start, which a single
timed call would charge to whichever algorithm came first. The first size starts with one untimed call of each
algorithm on 4 KiB (first use of its groups); each batch ends with a check of the sum. Every size gets one round;
a second round (the algorithms in reverse order) runs while the measurement so far has taken less than
``BUDGET_S``. On a fast fabric the whole measurement takes milliseconds; over a slow link it is about
``4 x batch_calls`` calls of each bucket size (no size is guessed from another: the best algorithm changes with
the size)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from trainer.parallel.comm import ALGORITHMS, HierGroups

ROUNDS = 2  # at most
BUDGET_S = 0.5
BATCH_BYTES = 1 << 20  # a batch moves about this much: 8 calls of a small bucket, 2 of a large one


def batch_calls(size: int) -> int:
    return max(2, min(8, BATCH_BYTES // max(size, 1)))


def bucket_sizes(seen: list[int]) -> list[int]:
    """The distinct bucket sizes (bytes) of one backward pass, ascending; sizes within 10% of a smaller one are
    the same size for timing."""
    out: list[int] = []
    for size in sorted(set(seen)):
        if not out or size > out[-1] * 1.1:
            out.append(size)
    return out


def _run_batch(name: str, x: torch.Tensor, calls: int, groups: HierGroups, device: torch.device) -> float:
    """Seconds per call of ``calls`` back-to-back calls; raises if the sum of ones is not the world size."""
    t0 = time.perf_counter()
    for _ in range(calls):
        x.fill_(1.0)
        ALGORITHMS[name](x, groups)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / calls
    if not (x[0] == groups.world_size and x[-1] == groups.world_size):
        raise RuntimeError(
            f"comm.allreduce=auto: the {name} all-reduce of {x.numel() * 4} bytes gave {float(x[0])} instead of "
            f"{groups.world_size} on rank {dist.get_rank()}"
        )
    return seconds


def setup_of(groups: HierGroups) -> dict:
    """What a plan is valid for: a plan measured under another topology or comm settings is measured again."""
    return {
        "topology": [groups.num_nodes, groups.ranks_per_node],
        "compress": groups.compress,
        "chunk_bytes": groups.chunk_bytes,
    }


def mismatches(plan: dict, wanted: dict) -> list[str]:
    """How ``plan`` differs from ``wanted`` (``setup_of`` this run), one "KEY PLAN_VALUE (this run: VALUE)" each; a
    key the plan lacks (written before it was recorded) counts as different."""
    return [f"{k} {plan.get(k)} (this run: {v})" for k, v in wanted.items() if plan.get(k) != v]


def measure(groups: HierGroups, sizes: list[int], device: torch.device, *, one_network: bool = False) -> dict:
    """The plan for these bucket sizes (bytes): see runconfig/allreduce_plan.py for its use and table. With
    ``one_network`` (every rank on one host in one network namespace: every "inter-node" link is loopback) the
    figures are measured and recorded but flat is chosen for every size: there the other algorithms, faster when
    timed alone, lost in training (docs/measurements/overhead.md, "one host, more rounds, and the CPU a step
    costs")."""
    names = list(ALGORITHMS)
    start = time.perf_counter()
    rows: list[dict] = []
    measured_s = 0.0
    for i, size in enumerate(sizes):
        x = torch.empty(max(1, size // 4), dtype=torch.float32, device=device)
        if i == 0:  # first use of each algorithm's groups, on a small piece: set-up costs, not bandwidth
            for name in names:
                _run_batch(name, x[: min(x.numel(), 1024)], 1, groups, device)
        best = torch.full((len(names),), float("inf"), dtype=torch.float64)
        for rnd in range(ROUNDS):
            mine = torch.zeros(len(names) + 1, dtype=torch.float64)
            for name in names if rnd % 2 == 0 else names[::-1]:
                mine[names.index(name)] = _run_batch(name, x, batch_calls(size), groups, device)
            mine[-1] = time.perf_counter() - start
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=groups.world)  # the slowest rank's figures and clock
            best = torch.minimum(best, mine[:-1])
            measured_s = float(mine[-1])
            if measured_s > BUDGET_S:  # every rank reads the same (agreed) clock: the same decision
                break
        seconds = {name: float(best[j]) for j, name in enumerate(names)}
        choice = "flat" if one_network else min(names, key=lambda n: seconds[n])
        rows.append({"bytes": size, "seconds": seconds, "choice": choice})
    return {
        **setup_of(groups),
        "one_network": one_network,
        "algorithms": names,
        "sizes": rows,
        "measured_s": round(measured_s, 4),
        "timing": (
            f"per call, in batches of 2-8 back-to-back calls (about {BATCH_BYTES >> 20} MiB a batch), the slowest "
            f"rank's; the best of {ROUNDS} rounds while within {BUDGET_S} s, else of 1"
        ),
    }
