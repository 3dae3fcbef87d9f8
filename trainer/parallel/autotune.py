"""``comm.allreduce: auto``: time flat and each hierarchical variant on the run's own process groups for the
bucket sizes DDP uses, and pick the fastest per size only where it beats flat clearly (Horovod's autotuner is the
model; on a GPU cluster NCCL's own tree and NVLS algorithms may make flat the winner, and then flat is chosen).

Collective: every rank runs the same calls in the same order. Per size, each algorithm runs a batch of
``batch_calls(size)`` back-to-back calls (as DDP issues its buckets) per round; a batch's time per call is the
slowest rank's (one all-reduce MAX per round), so every rank computes the same figures and the same choices. The
first size starts with an untimed batch of each algorithm on up to ``WARM_BYTES`` (first use of its groups, and the
ranks' start); each batch starts at a barrier (the skew left by the previous batch is not charged to the next) and
ends with a check of the sum; a size whose calls are expected to take over ``LONG_CALL_S`` (from the previous size)
runs one call a batch. Robust to a noisy start: after 2 rounds (after 1 where that one overran the budget: long
calls, little noise), an algorithm whose best round is slower than ``PRUNE`` x the best's drops out (flat too,
having lost by more than the margin); every size gets 2 rounds or more (the order reversed each round; 1 where only
one algorithm is left then), and more, up to ``MAX_ROUNDS``, while they are cheap (the size has taken under
``BUDGET_S``) or the leader has not won every round (at most 3 then; 2 for a size timed a call a batch). An
algorithm's figure is its median over the rounds; one other than flat is chosen only if its median is ``MARGIN``
faster than flat's and it beat flat in every round: flat when unsure. ``pipelined`` is a candidate only where it
differs from ``hierarchical`` (more than one node of more than one rank, no ``comm.chunk_kb``, buckets over two
chunks)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from trainer.parallel.comm import ALGORITHMS, PIPE_CHUNK_BYTES, HierGroups

MAX_ROUNDS = 5
BUDGET_S = 0.5  # per size: rounds beyond the first 2 while the size has taken less than this (or the leader wavers)
PRUNE = 1.25  # once pruned, an algorithm (flat too) whose best round is this much slower than the best's drops out
LONG_CALL_S = 0.25  # a size whose calls are expected to take longer is timed one call a batch: no skew to amortize
MARGIN = 0.05  # an algorithm other than flat is chosen only where its median is this much faster
WARM_BYTES = 64 << 10  # the first size starts with an untimed batch of each algorithm on this much (at most)
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
    """Seconds per call of ``calls`` back-to-back calls, from a barrier (the ranks' skew from the previous batch is
    not charged to this one); raises if the sum of ones is not the world size."""
    dist.barrier()  # the default group, which no algorithm uses: a call on the barrier's own group is favoured
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


def candidates(groups: HierGroups, size: int) -> list[str]:
    """The algorithms timed for a bucket of ``size`` bytes: all of them, but ``pipelined`` only where it would not
    run exactly as ``hierarchical`` does."""
    pipelines = groups.num_nodes > 1 and groups.ranks_per_node > 1 and not groups.chunk_bytes
    return [n for n in ALGORITHMS if n != "pipelined" or (pipelines and size > 2 * PIPE_CHUNK_BYTES)]


def choose_algorithm(per_round: dict[str, list[float]]) -> str:
    """The choice from each algorithm's per-round seconds (flat's always complete): the fastest by median, if it is
    flat or beats flat by ``MARGIN`` and in every round both ran; otherwise flat."""
    median = {n: statistics.median(t) for n, t in per_round.items()}
    best = min(median, key=lambda n: (median[n], n != "flat"))
    if best == "flat":
        return best
    flat, mine = per_round["flat"], per_round[best]
    clear = median[best] * (1 + MARGIN) <= median["flat"] and all(m < f for m, f in zip(mine, flat, strict=False))
    return best if clear else "flat"


def _leads(per_round: dict[str, list[float]], alive: list[str]) -> bool:
    """Whether one algorithm was the fastest of ``alive`` in every round so far (the decision is not in doubt)."""
    rounds = min(len(per_round[n]) for n in alive)
    winners = {min(alive, key=lambda n, r=r: per_round[n][r]) for r in range(rounds)}
    return len(winners) == 1


def measure(groups: HierGroups, sizes: list[int], device: torch.device, *, one_network: bool = False) -> dict:
    """The plan for these bucket sizes (bytes): see rundir/allreduce_plan.py for its use and table. With
    ``one_network`` (every rank on one host in one network namespace: every "inter-node" link is loopback) flat is
    chosen for every size without measuring: there the other algorithms, faster when timed alone, lost in training
    (docs/measurements/overhead.md, "one host, more rounds, and the CPU a step costs"), and the measurement cost
    every rank start-up time for figures no choice used."""
    names = list(ALGORITHMS)
    if one_network:
        rows = [{"bytes": size, "seconds": {}, "choice": "flat", "rounds": 0, "calls": 0, "per_round_s": {}}
                for size in sizes]  # fmt: skip
        return {**setup_of(groups), "one_network": True, "algorithms": names, "sizes": rows, "measured_s": 0.0,
                "timing": "not measured: flat for every size"}  # fmt: skip
    start = time.perf_counter()
    rows: list[dict] = []
    for i, size in enumerate(sizes):
        x = torch.empty(max(1, size // 4), dtype=torch.float32, device=device)
        if i == 0:  # first use of each algorithm's groups, on a small piece: set-up costs and the ranks' start
            for name in names:
                _run_batch(name, x[: min(x.numel(), WARM_BYTES // 4)], batch_calls(WARM_BYTES), groups, device)
        alive = candidates(groups, size)
        per_round: dict[str, list[float]] = {name: [] for name in alive}
        size_start = time.perf_counter()
        # The previous size's fastest median, scaled: a long call is timed alone (a round of 2 would take minutes).
        expected = min(rows[-1]["seconds"].values()) * size / rows[-1]["bytes"] if rows else 0.0
        calls = 1 if expected > LONG_CALL_S else batch_calls(size)
        pruned = False
        for rnd in range(MAX_ROUNDS):
            mine = torch.zeros(len(names) + 1, dtype=torch.float64)
            for name in alive if rnd % 2 == 0 else alive[::-1]:
                mine[names.index(name)] = _run_batch(name, x, calls, groups, device)
            mine[-1] = time.perf_counter() - size_start
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=groups.world)  # the slowest rank's figures and clock
            for name in alive:
                per_round[name].append(float(mine[names.index(name)]))
            elapsed = float(mine[-1])  # every rank reads the same (agreed) clock: the same decision
            done = rnd + 1
            # Once, after 2 rounds or the first that overran the budget (a long call, timed with little noise): an
            # algorithm whose best round is far behind the best has clearly lost (flat too: by more than the margin).
            if not pruned and (done >= 2 or elapsed > BUDGET_S):
                pruned, best = True, {n: min(per_round[n]) for n in alive}
                alive = [n for n in alive if best[n] <= PRUNE * min(best.values())]
            enough = calls == 1 or done >= 3 or _leads(per_round, alive)  # a long call is timed with little noise
            if len(alive) == 1 or (done >= 2 and elapsed > BUDGET_S and enough):
                break
        seconds = {name: statistics.median(t) for name, t in per_round.items()}
        choice = choose_algorithm({n: per_round[n] for n in {*alive, "flat"}})
        rounds = max(len(t) for t in per_round.values())
        per_round_s = {n: [round(v, 6) for v in t] for n, t in per_round.items()}
        rows.append({"bytes": size, "seconds": seconds, "choice": choice, "rounds": rounds, "calls": calls,
                     "per_round_s": per_round_s})  # fmt: skip
    measured = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=groups.world)
    return {
        **setup_of(groups),
        "one_network": one_network,
        "algorithms": names,
        "sizes": rows,
        "measured_s": round(float(measured[0]), 4),
        "timing": (
            f"per call, in batches of 2-8 back-to-back calls from a barrier (about {BATCH_BYTES >> 20} MiB a batch; "
            f"1 call where one takes over {LONG_CALL_S} s), the slowest rank's; the median of 2-{MAX_ROUNDS} rounds; "
            f"other than flat only where {MARGIN:.0%} faster and faster in every round"
        ),
    }
