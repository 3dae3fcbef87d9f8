"""The gradient all-reduce algorithms and the DDP communication hooks that run them.

Algorithms (each sums a tensor over all ranks in place; ``ALGORITHMS``):

- ``flat``: one all-reduce over all ranks, on a world group of its own (so that nothing the training thread
  issues on the default group can interleave with it).
- ``hierarchical``: intra-node reduce-scatter, inter-node all-reduce of the shard, intra-node all-gather: only
  1/ranks_per_node of the data crosses the inter-node fabric per rank; pipelined over chunks with ``comm.chunk_kb``.
- ``leader``: reduce to the node's first rank, all-reduce among the node leaders, broadcast inside the node.
- ``two_level``: all-reduce inside the node, then among the ranks with the same local index on every node.
- ``pipelined``: hierarchical over chunks of ``comm.chunk_kb`` (``PIPE_CHUNK_BYTES`` where that is unset), its
  three phases overlapped: for large buckets over a slow link.

``comm.allreduce: auto`` measures them at start-up (autotune.py) and ``BucketDispatch`` picks one per bucket size.
Hooks: ``overlapped_hook`` (CPU: a ``BucketReducer`` thread reduces the buckets in arrival order while backward
goes on), ``stream_hook`` (CUDA: the autograd thread issues each bucket's collectives at once on a ``SideStream``;
no thread, as issuing an NCCL collective blocks nothing on the host) and ``sync_hook`` (inside the hook, blocking:
the reference the other two are tested bit-identical against). All rely on every rank issuing the same
collectives in the same order on each group (why that holds: the comment above ``sync_hook``).
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

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single (the old names warn there); older
# releases (the package supports torch >= 2.6) have only the old names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


class Released:
    """What a released group's field holds: any use fails, naming why (None would mean the default group)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:  # torch's "Process group ... is not initialized" names it so
        return f"<the {self._name} process group, released after start-up: no hook reduces with it in this run>"

    def __getattr__(self, attr: str):
        raise RuntimeError(f"{self!r} used ({attr})")


@dataclass
class HierGroups:
    intra: dist.ProcessGroup  # the ranks on this node
    inter: dist.ProcessGroup  # the ranks with this local index on every node
    ranks_per_node: int
    num_nodes: int
    blocked: BlockedIntervals = field(default_factory=BlockedIntervals, compare=False)  # for the step clock
    compress: bool = False  # comm.compress: bf16 on the inter-node link
    chunk_bytes: int = 0  # comm.chunk_kb: buckets larger than this are reduced in pipelined chunks of this size
    world: dist.ProcessGroup | None = None  # all ranks, for the flat algorithm inside hooks (None: the default group)

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.num_nodes

    def release(self) -> int:
        """Destroy the groups of its own (never the default group) once nothing will use them: start-up's link
        test and all-reduce measurements are done and DDP's own all-reduce runs, with no hook. Each gloo group
        keeps a polling thread that wakes whether or not the group is used, and on ranks sharing cores each wake-up
        takes a core from a training thread (docs/measurements/overhead.md, "idle gloo groups"). Collective (every
        rank releases at the same point). Returns how many groups were destroyed."""
        default = dist.group.WORLD
        released = 0
        for name in ("intra", "inter", "world"):
            group = getattr(self, name)
            if isinstance(group, Released):
                continue
            if group is not default:  # every rank is a member of its own groups
                dist.destroy_process_group(group)
                released += 1
            setattr(self, name, Released(name))
        return released


class _InterReduce:
    """An all-reduce of ``tensor`` over ``group`` (by default the inter-node group), asynchronous until ``wait``;
    in bfloat16 on the wire with ``groups.compress`` (the slow link carries half)."""

    def __init__(self, tensor: torch.Tensor, groups: HierGroups, group: dist.ProcessGroup | None = None) -> None:
        self.tensor = tensor
        self.low = tensor.to(torch.bfloat16) if groups.compress and tensor.dtype == torch.float32 else None
        wire = tensor if self.low is None else self.low
        self.work = dist.all_reduce(wire, group=groups.inter if group is None else group, async_op=True)

    def wait(self) -> None:
        self.work.wait()
        if self.low is not None:
            self.tensor.copy_(self.low)


def _pipelined(buf: torch.Tensor, chunk: int, groups: HierGroups) -> None:
    """The three phases over chunks of ``chunk`` elements (a multiple of the node size), overlapped: while chunk
    i crosses the inter-node link, chunk i+1 is reduce-scattered and chunk i-1 all-gathered inside the node. Each
    group sees its collectives issued in one fixed order (intra: RS0 RS1 AG0 RS2 AG1 ...; inter: AR0 AR1 ...) on
    every rank; an element's sum takes the same path as without chunks, so integer-valued sums stay exact."""
    k, intra = groups.ranks_per_node, groups.intra
    pieces = list(buf.split(chunk))
    shards = [p.new_empty(p.numel() // k) for p in pieces]
    rs = {0: reduce_scatter_single(shards[0], pieces[0], group=intra, async_op=True)}
    inter: dict[int, _InterReduce] = {}
    gathers = []
    for i in range(len(pieces)):
        rs.pop(i).wait()
        inter[i] = _InterReduce(shards[i], groups)
        if i + 1 < len(pieces):
            rs[i + 1] = reduce_scatter_single(shards[i + 1], pieces[i + 1], group=intra, async_op=True)
        if i >= 1:
            inter.pop(i - 1).wait()
            gathers.append(all_gather_single(pieces[i - 1], shards[i - 1], group=intra, async_op=True))
    last = len(pieces) - 1
    inter.pop(last).wait()
    gathers.append(all_gather_single(pieces[last], shards[last], group=intra, async_op=True))
    for work in gathers:
        work.wait()


def hierarchical_all_reduce(tensor: torch.Tensor, groups: HierGroups, chunk_bytes: int | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place and return it. Any length: padded to a multiple of the node size.
    With ``groups.chunk_bytes`` (or ``chunk_bytes``; and more than one node), a tensor larger than that goes through
    the phases in chunks of about that size, pipelined (``_pipelined``)."""
    chunk_bytes = groups.chunk_bytes if chunk_bytes is None else chunk_bytes
    flat = tensor.view(-1)
    k = groups.ranks_per_node
    if k == 1:
        if groups.num_nodes > 1:
            _InterReduce(flat, groups).wait()
        return tensor
    n = flat.numel()
    padded_len = -(-n // k) * k
    if padded_len == n:
        buf = flat
    else:
        buf = flat.new_zeros(padded_len)
        buf[:n].copy_(flat)
    chunk = max(k, chunk_bytes // buf.element_size() // k * k) if chunk_bytes else padded_len
    if groups.num_nodes > 1 and chunk < padded_len:
        _pipelined(buf, chunk, groups)
        if buf is not flat:
            flat.copy_(buf[:n])
        return tensor
    shard = buf.new_empty(padded_len // k)
    reduce_scatter_single(shard, buf, group=groups.intra)
    if groups.num_nodes > 1:
        _InterReduce(shard, groups).wait()
    all_gather_single(buf, shard, group=groups.intra)
    if buf is not flat:
        flat.copy_(buf[:n])
    return tensor


def two_level_all_reduce(tensor: torch.Tensor, groups: HierGroups) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place: an all-reduce inside the node, then one among the ranks with this
    local index on every node. Two collectives instead of three, but every rank sends the whole tensor over the
    inter-node link: for small, latency-bound buckets."""
    dist.all_reduce(tensor, group=groups.intra)
    if groups.num_nodes > 1:
        _InterReduce(tensor, groups).wait()
    return tensor


def leader_all_reduce(tensor: torch.Tensor, groups: HierGroups) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place: reduce to the node's first rank, all-reduce among those node leaders,
    broadcast inside the node. Only the leaders cross the inter-node link, with the whole tensor: for small
    buckets, where one link crossing per node beats the ring's several."""
    dist.reduce(tensor, group_dst=0, group=groups.intra)
    if groups.num_nodes > 1 and dist.get_rank(groups.intra) == 0:
        _InterReduce(tensor, groups).wait()
    dist.broadcast(tensor, group_src=0, group=groups.intra)
    return tensor


def flat_all_reduce(tensor: torch.Tensor, groups: HierGroups) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place with one all-reduce (in bfloat16 with ``groups.compress``: every
    byte of a flat all-reduce may cross the slow link)."""
    _InterReduce(tensor, groups, groups.world).wait()
    return tensor


PIPE_CHUNK_BYTES = 1 << 20  # the pipelined algorithm's chunk where comm.chunk_kb is unset (best at 1 MiB, 200 Mbit/s)


def pipelined_all_reduce(tensor: torch.Tensor, groups: HierGroups) -> torch.Tensor:
    """The hierarchical all-reduce over chunks of ``comm.chunk_kb``, or of ``PIPE_CHUNK_BYTES`` where it is unset:
    while one chunk crosses the inter-node link the next is reduce-scattered inside the node."""
    return hierarchical_all_reduce(tensor, groups, groups.chunk_bytes or PIPE_CHUNK_BYTES)


ALGORITHMS: dict[str, Callable[[torch.Tensor, HierGroups], torch.Tensor]] = {
    "flat": flat_all_reduce,
    "hierarchical": hierarchical_all_reduce,
    "leader": leader_all_reduce,
    "two_level": two_level_all_reduce,
    "pipelined": pipelined_all_reduce,
}


class BucketDispatch:
    """Averages a gradient bucket with one algorithm, or per bucket size with a plan (``comm.allreduce: auto``):
    ``choose(nbytes)`` gives the algorithm's name. Until a plan is set buckets go flat."""

    def __init__(self, groups: HierGroups, algorithm: str | None = None) -> None:
        self.groups = groups
        self.algorithm = algorithm  # a fixed choice; None: by the plan
        self.plan: Callable[[int], str] | None = None
        # The distinct sizes (bytes) of DDP's buckets once it has rebuilt them (``buckets.ddp_bucket_bytes`` after
        # the throw-away passes): the sizes a plan is measured for and the overlapped path is checked on.
        self.sizes: list[int] = []
        # The overlapped hook's path for one buffer, without DDP (``BucketReducer.submit``, ``SideStream.reduce``),
        # for ``check_overlapped``; None where the synchronous hook runs.
        self.overlapped: Callable[[torch.Tensor], torch.futures.Future[torch.Tensor]] | None = None
        self.busy_s = 0.0  # wall seconds spent reducing buckets (overlapped with backward or not), see take_busy
        # False where the reduction runs on a CUDA stream (``stream_hook``): the host's clock sees only the issue.
        self.host_timed = True

    def take_busy(self) -> float | None:
        """Seconds spent reducing since the last call (read by the training thread between steps, when the
        reducer is idle); None where the host's clock cannot see the reduction (``host_timed`` false)."""
        busy, self.busy_s = self.busy_s, 0.0
        return busy if self.host_timed else None

    def choose(self, nbytes: int) -> str:
        if self.algorithm is not None:
            return self.algorithm
        if self.plan is None:
            return "flat"
        return self.plan(nbytes)

    def __call__(self, buf: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        name = self.choose(buf.numel() * buf.element_size())
        ALGORITHMS[name](buf, self.groups).div_(self.groups.world_size)
        self.busy_s += time.perf_counter() - start
        return buf


# The hooks rely on every rank issuing the same collectives in the same order on each group: DDP launches buckets in
# index order on every rank, the algorithm depends only on the bucket's size and a plan all ranks share, and nothing
# else uses these groups in training. Do not chain the phases through futures' callbacks: ranks can then issue them
# in different orders, and hang.
def sync_hook(dispatch: BucketDispatch, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients inside the hook (blocking backward)."""
    buf = bucket.buffer()
    blocked = dispatch.groups.blocked
    start = blocked.enter()
    dispatch(buf)
    blocked.add(start, time.perf_counter())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


class BucketReducer:
    """A thread that averages DDP's gradient buckets with ``dispatch``, in the order they were handed over, while
    the training thread goes on with backward. One per rank, for the process's life: a daemon, idle between
    backward passes (DDP has waited for every bucket before backward returns)."""

    def __init__(self, dispatch: BucketDispatch) -> None:
        self.dispatch = dispatch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bucket-reducer", daemon=True)
        self._thread.start()

    def submit(self, buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._queue.put((buf, fut))
        return fut

    def _run(self) -> None:
        while True:
            buf, fut = self._queue.get()
            try:
                self.dispatch(buf)
            except Exception as exc:  # noqa: BLE001 (a failed collective reaches DDP, on the training thread)
                fut.set_exception(exc)
            else:
                fut.set_result(buf)


def overlapped_hook(reducer: BucketReducer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients on the reducer's thread; DDP waits for the returned
    future at the end of backward."""
    return reducer.submit(bucket.buffer())


class SideStream:
    """The gradient reduction's own CUDA stream on this rank's device, for ``stream_hook``."""

    def __init__(self, dispatch: BucketDispatch, device: torch.device) -> None:
        self.dispatch = dispatch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        dispatch.host_timed = False

    def reduce(self, buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Average ``buf`` on the side stream, after it has waited for the compute stream (where ``buf`` was
        written). Every phase's collective and wait is issued here and now, relative to the side stream: NCCL's
        streams wait for it, and it waits for them, so the compute stream never does. The future is completed at
        once; completing it records an event on the side stream, and a wait on it (DDP's, at the end of backward)
        makes the waiting stream wait for that event alone. Temporaries are allocated on the side stream and freed
        after their last use there; ``buf`` (DDP's bucket) outlives the step."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.dispatch(buf)
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[self.device])
            fut.set_result(buf)
        return fut


def stream_hook(side: SideStream, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook (CUDA): average the bucket on the side stream (``SideStream.reduce``)."""
    return side.reduce(bucket.buffer())


CHECK_DELAY_CYCLES = 20_000_000  # GPU clock cycles the compute stream spins before writing the check's input


def check_overlapped(dispatch: BucketDispatch, sizes: list[int], device: torch.device) -> list[int]:
    """Collective: the ranks on which the overlapped path (``dispatch.overlapped``: the reducer's thread, or the
    CUDA side stream) did not give the synchronous path's bits, for a buffer of each size in ``sizes`` (each
    reduced with the algorithm its size gets); [] when it did on every rank. The values are small integers, so
    every algorithm's sum is exact, and both paths run the same collectives.

    On CUDA it is the test of the two stream orderings the hook relies on. The input is written on the compute
    stream behind a spinning kernel (``CHECK_DELAY_CYCLES``), so a side stream that did not wait for the compute
    stream would read the buffer before it is written; the result is compared on the compute stream after a wait
    on the future, as DDP waits, so a future that did not order that stream after the reduction would compare the
    unreduced input."""
    bad = torch.zeros(dist.get_world_size(dispatch.groups.world), dtype=torch.int32, device=device)
    me = dist.get_rank(dispatch.groups.world)
    for size in sizes:
        pattern = torch.arange(max(1, size // 4), dtype=torch.float32, device=device).remainder_(13).add_(me % 3)
        want = dispatch(pattern.clone())
        got = torch.zeros_like(pattern)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            spin = getattr(torch.cuda, "_sleep", None)  # torch's own test helper: a kernel that spins N cycles
            if spin is not None:
                spin(CHECK_DELAY_CYCLES)
        got.copy_(pattern)
        assert dispatch.overlapped is not None
        dispatch.overlapped(got).wait()
        if not torch.equal(got, want):
            bad[me] = 1
    dist.all_reduce(bad, group=dispatch.groups.world)
    dispatch.take_busy()  # the check's reductions are no step's
    return [rank for rank, flag in enumerate(bad.tolist()) if flag]
