"""``comm.allreduce: auto``: time flat and each hierarchical variant on the run's own process groups for the
bucket sizes DDP uses, and pick the fastest per size (Horovod's autotuner is the model; on a GPU cluster NCCL's
own tree and NVLS algorithms may make flat the winner, and then flat is chosen).

Collective: every rank runs the same calls in the same order. Each rank times ``REPEATS`` calls of each algorithm
per size (after one untimed call that also checks the sum); the figures are the slowest rank's (one all-reduce
MAX), so every rank computes the same medians and the same choices. Sizes are measured smallest first; once the
measurement has taken ``BUDGET_S`` (slowest rank's clock) the remaining, larger sizes take the largest measured
size's choice (bandwidth-bound sizes keep their order)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from trainer.parallel.comm import ALGORITHMS, HierGroups

REPEATS = 3
BUDGET_S = 2.0


def bucket_sizes(seen: list[int]) -> list[int]:
    """The distinct bucket sizes (bytes) of one backward pass, ascending; sizes within 10% of a smaller one are
    the same size for timing."""
    out: list[int] = []
    for size in sorted(set(seen)):
        if not out or size > out[-1] * 1.1:
            out.append(size)
    return out


def measure(groups: HierGroups, sizes: list[int], device: torch.device) -> dict:
    """The plan for these bucket sizes (bytes): see runconfig/allreduce_plan.py for its use and table."""
    names = list(ALGORITHMS)
    start = time.perf_counter()
    rows: list[dict] = []
    for size in sizes:
        x = torch.empty(max(1, size // 4), dtype=torch.float32, device=device)
        mine = torch.zeros(len(names), REPEATS + 1, dtype=torch.float64)
        for rep in range(REPEATS + 1):  # rep 0: untimed (first use of a size, and the check of the sum)
            order = names if rep % 2 == 0 else names[::-1]  # alternated, so no algorithm always goes first
            for name in order:
                x.fill_(1.0)
                t0 = time.perf_counter()
                ALGORITHMS[name](x, groups)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                mine[names.index(name), rep] = time.perf_counter() - t0
                if rep == 0 and not (x[0] == groups.world_size and x[-1] == groups.world_size):
                    raise RuntimeError(
                        f"comm.allreduce=auto: the {name} all-reduce of {size} bytes gave {float(x[0])} instead "
                        f"of {groups.world_size} on rank {dist.get_rank()}"
                    )
        figures = torch.cat([mine.flatten(), torch.tensor([time.perf_counter() - start], dtype=torch.float64)])
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=groups.world)
        slowest = figures[:-1].view(len(names), REPEATS + 1)[:, 1:]
        seconds = {name: statistics.median(slowest[i].tolist()) for i, name in enumerate(names)}
        rows.append({"bytes": size, "seconds": seconds, "choice": min(names, key=lambda n: seconds[n])})
        if float(figures[-1]) > BUDGET_S:
            break
    for size in sizes[len(rows) :]:
        rows.append({"bytes": size, "seconds": {}, "choice": rows[-1]["choice"]})
    return {
        "topology": [groups.num_nodes, groups.ranks_per_node],
        "algorithms": names,
        "sizes": rows,
        "measured_s": round(time.perf_counter() - start, 4),
        "repeats": REPEATS,
        "timing": "median over repeats of the slowest rank's time per call",
        "compress": groups.compress,
        "chunk_bytes": groups.chunk_bytes,
    }
