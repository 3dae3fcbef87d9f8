"""Silent corruption caught (``monitor.replica_check_every``): data-parallel replicas hold bit-identical weights
(DDP's ranks, HSDP's replicas of each shard), so every N steps, and before every checkpoint is saved, the ranks
compare a digest of their own parameters with the ranks holding the same part of the model (the same pipeline
stage, FSDP shard and tensor-parallel slice). A replica whose digest differs from the majority is named with its
node; with no majority (two replicas) the ranks that disagree are named in the message and no node is blamed.
Every committed checkpoint was therefore checked at its step: a launch that ends on a mismatch restarts from the
newest one, which predates the divergence.

The digest: per parameter, its raw bits read as integers (float32 as int32, bf16 as int16, ...) summed in int64 on
the device (one bit flipped changes the sum), then SHA-256 over those sums: one small string per rank gathered.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from runconfig.layout import Layout
from trainer.env import RuntimeEnv
from trainer.observe.memory import local_part

INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicasDiverged(Exception):
    """Raised by every rank after a check found replicas that differ; ``info``: the verdict."""

    def __init__(self, info: dict) -> None:
        super().__init__(info["message"])
        self.info = info


def digest(model: nn.Module) -> str:
    """This rank's parameters, bit for bit, as one short string (one device-to-host copy)."""
    sums = []
    for _, p in sorted(model.named_parameters(), key=lambda item: item[0]):
        t = local_part(p.detach())
        if t.numel() == 0:
            continue
        bits = t.contiguous().view(INT_OF[t.element_size()]) if t.is_floating_point() else t
        sums.append(bits.sum(dtype=torch.int64))
    values = torch.stack(sums).cpu().tolist() if sums else []
    return hashlib.sha256(",".join(map(str, values)).encode()).hexdigest()[:24]


def replica_key(layout: Layout, rank: int) -> tuple[int, int, int, int]:
    """The part of the model a rank holds: its (pipeline stage, FSDP shard, tensor-parallel slice); FSDP2 shards
    over dp_shard x cp, so the context-parallel coordinate is part of the shard."""
    c = layout.coords(rank)
    return c["pp"], c["dp_shard"], c["cp"], c["tp"]


def verdict(digests: list[str], layout: Layout, env: RuntimeEnv, step: int) -> dict | None:
    """None when every group of replicas agrees; else what differs, who is named, and why (same on every rank)."""
    groups: dict[tuple, list[int]] = {}
    for rank in range(len(digests)):
        groups.setdefault(replica_key(layout, rank), []).append(rank)
    odd, unresolved = [], []
    for ranks in groups.values():
        seen: dict[str, list[int]] = {}
        for r in ranks:
            seen.setdefault(digests[r], []).append(r)
        if len(seen) < 2:
            continue
        best = max(seen.values(), key=len)
        if 2 * len(best) > len(ranks):  # a strict majority: the others are the corrupt replicas
            odd += [r for d, rs in seen.items() if rs is not best for r in rs]
        else:
            unresolved.append(sorted(ranks))
    if not odd and not unresolved:
        return None
    parts = []
    if odd:
        named = ", ".join(f"rank {r} ({env.node_names[r]})" for r in sorted(odd))
        parts.append(f"{named} hold(s) parameters that differ from the other replicas of the same part of the model")
    for ranks in unresolved:
        parts.append(f"replicas {', '.join(map(str, ranks))} disagree with no majority (no node is named)")
    message = (
        f"silent corruption: at step {step} the data-parallel replicas' weights are not identical: "
        + "; ".join(parts)
        + ". The launch ends without a checkpoint; the run restarts from the newest committed one (checked at its "
        "step), the named node(s) left out."
    )
    return {"step": step, "ranks": sorted(odd), "unresolved": unresolved, "message": message}


class ReplicaCheck:
    def __init__(self, every: int, layout: Layout, env: RuntimeEnv) -> None:
        self.every, self.layout, self.env = every, layout, env
        # off, or nothing to compare (every part of the model held by one rank: FSDP without replicas, TP, PP)
        groups = {replica_key(layout, r) for r in range(env.world_size)}
        self.enabled = every > 0 and len(groups) < env.world_size
        self.checks = 0

    def due(self, step: int, checkpoint: bool) -> bool:
        return self.enabled and (checkpoint or step % self.every == 0)

    def check(self, model: nn.Module, step: int) -> None:
        """Collective: raises ReplicasDiverged on every rank when replicas differ."""
        gathered: list = [None] * self.env.world_size
        dist.all_gather_object(gathered, digest(model))
        self.checks += 1
        found = verdict(gathered, self.layout, self.env, step)
        if found is not None:
            raise ReplicasDiverged(found)
