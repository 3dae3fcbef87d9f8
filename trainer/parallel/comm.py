"""Hierarchical all-reduce (intra-node reduce-scatter, inter-node all-reduce, intra-node all-gather).

On GPU clusters the intra-node phases run over NVLink and only 1/ranks_per_node of the data crosses the
inter-node fabric per rank. Two DDP communication hooks run it:

- ``overlapped_hook`` (the trainer's, on CPU): the hook hands the bucket to a ``BucketReducer``, a thread of its
  own that reduces DDP's buckets one after another in the order the hook received them, and returns a future that
  completes when the bucket is reduced; backward goes on meanwhile. DDP's reducer launches buckets in bucket index
  order on every rank, and nothing else issues collectives on the intra- and inter-node groups during training,
  so every rank issues the same collectives in the same order on each group. (Chaining the phases through
  futures' callbacks instead lets ranks issue them in different orders, a hang measured on torch 2.13; gloo has no
  future for a reduce-scatter anyway: see shared notes.)
- ``hierarchical_hook``: the same three phases run synchronously inside the hook, blocking backward while each
  bucket is reduced (on CUDA, where a side stream would be needed to overlap, and as the reference the overlapped
  one is tested against: both end bit-identical).
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook checks the hook's annotations at run
# time and rejects string annotations.
import queue
import threading
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


class BucketReducer:
    """A thread that reduces DDP's gradient buckets hierarchically, in the order they were handed over, while the
    training thread goes on with backward. One per rank; a daemon (idle between backward passes)."""

    def __init__(self, groups: HierGroups) -> None:
        self.groups = groups
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bucket-reducer", daemon=True)
        self._thread.start()

    def submit(self, buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._queue.put((buf, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            buf, fut = item
            try:
                hierarchical_all_reduce(buf, self.groups).div_(self.groups.world_size)
            except Exception as exc:  # noqa: BLE001 (a failed collective reaches DDP, on the training thread)
                fut.set_exception(exc)
            else:
                fut.set_result(buf)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


def overlapped_hook(reducer: BucketReducer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients with the hierarchical all-reduce, on the reducer's
    thread; DDP waits for the returned future at the end of backward."""
    return reducer.submit(bucket.buffer())
