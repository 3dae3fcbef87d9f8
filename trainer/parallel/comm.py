"""Hierarchical all-reduce (intra-node reduce-scatter, inter-node all-reduce, intra-node all-gather).

On GPU clusters the intra-node phases run over NVLink and only 1/ranks_per_node of the data crosses the
inter-node fabric per rank. ``hierarchical_hook`` plugs it into DDP as a communication hook. The three phases
are issued synchronously, in the same order on every rank, and the hook returns a completed Future: gloo has no
futures for reduce-scatter, and chaining phases across buckets through callbacks lets ranks issue collectives
in different orders (a hang), as measured on torch 2.13 (see shared notes).
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook checks the hook's annotations at run
# time and rejects string annotations.
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class BlockedIntervals:
    """Host-clock intervals a synchronous communication hook spent blocked (filled by the hook, read per step)."""

    intervals: list[tuple[float, float]] = field(default_factory=list)
    # Told when the hook starts (True) and ends (False) blocking: the hang watchdog's phase.
    on_block: Callable[[bool], None] | None = None

    def enter(self) -> float:
        if self.on_block is not None:
            self.on_block(True)
        return time.perf_counter()

    def add(self, start: float, end: float) -> None:
        self.intervals.append((start, end))
        if self.on_block is not None:
            self.on_block(False)

    def take(self) -> list[tuple[float, float]]:
        out, self.intervals = self.intervals, []
        return out


@dataclass(frozen=True)
class HierGroups:
    intra: dist.ProcessGroup  # the ranks on this node
    inter: dist.ProcessGroup  # the ranks with this local index on every node
    ranks_per_node: int
    num_nodes: int
    blocked: BlockedIntervals = field(default_factory=BlockedIntervals, compare=False)  # for the step clock

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.num_nodes


def hierarchical_all_reduce(tensor: torch.Tensor, groups: HierGroups) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place and return it. Any length: padded to a multiple of the node size."""
    flat = tensor.view(-1)
    k = groups.ranks_per_node
    if k == 1:
        if groups.num_nodes > 1:
            dist.all_reduce(flat, group=groups.inter)
        return tensor
    n = flat.numel()
    padded_len = -(-n // k) * k
    if padded_len == n:
        buf = flat
    else:
        buf = flat.new_zeros(padded_len)
        buf[:n].copy_(flat)
    shard = buf.new_empty(padded_len // k)
    dist.reduce_scatter_single(shard, buf, group=groups.intra)
    if groups.num_nodes > 1:
        dist.all_reduce(shard, group=groups.inter)
    dist.all_gather_single(buf, shard, group=groups.intra)
    if buf is not flat:
        flat.copy_(buf[:n])
    return tensor


def hierarchical_hook(groups: HierGroups, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients with the hierarchical all-reduce."""
    buf = bucket.buffer()
    start = groups.blocked.enter()
    hierarchical_all_reduce(buf, groups).div_(groups.world_size)
    groups.blocked.add(start, time.perf_counter())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut
