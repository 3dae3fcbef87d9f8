"""The subset of mpi4py's ``MPI.Comm`` that the trainer uses, over a torch.distributed gloo group.

With job.spare_ranks the ranks are no MPI processes (hpc/spawn.py starts them, a spare takes a dead rank's place),
so their meetings go through this. Payloads are pickled and HMAC-checked with the launch's key before any is
unpickled."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import logging
import operator
import os
import pickle
import struct
import sys
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

MAC_BYTES = hashlib.sha256().digest_size


class GroupRequest:
    """What ``Ibarrier`` returns: mpi4py's ``Request.Test`` and ``Request.Wait`` over a torch ``Work``."""

    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def Test(self) -> bool:  # noqa: N802 (mpi4py's name)
        return bool(self._work.is_completed())

    def Wait(self) -> None:  # noqa: N802 (mpi4py's name)
        self._work.wait()


class GroupComm:
    """A drop-in for the trainer's ``MPI.Comm`` calls on ``group`` (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None, secret: bytes) -> None:
        self._group = group
        self._secret = bytes(secret)
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._calls = 0  # every rank counts its collective calls alike: a payload is bound to its call

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's name)
        return self._rank

    def Get_size(self) -> int:  # noqa: N802 (mpi4py's name)
        return self._size

    def _next(self) -> int:
        self._calls += 1
        return self._calls

    def _mac(self, sender: int, call: int, data: bytes) -> bytes:
        mac = hmac.new(self._secret, struct.pack(">qq", sender, call), hashlib.sha256)
        mac.update(data)
        return mac.digest()

    def _seal(self, obj: Any, call: int) -> bytes:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return self._mac(self._rank, call, data) + data

    def _check(self, payload: bytes, sender: int, call: int, method: str) -> bytes:
        """The pickled bytes of ``payload`` once its MAC holds; RuntimeError naming ``sender`` otherwise."""
        mac, data = payload[:MAC_BYTES], payload[MAC_BYTES:]
        if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, self._mac(sender, call, data)):
            raise RuntimeError(
                f"rank {sender}'s payload in GroupComm.{method} failed its check: not written by this launch's ranks"
            )
        return data

    def _global(self, rank: int) -> int:
        return rank if self._group is None else dist.get_global_rank(self._group, rank)

    def _allgather(self, obj: Any, method: str) -> list[Any]:
        call = self._next()
        payload = self._seal(obj, call)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self._size)]
        dist.all_gather(sizes, size, group=self._group)
        lengths = [int(s.item()) for s in sizes]
        longest = max(lengths)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self._size)]
        dist.all_gather(bufs, mine, group=self._group)
        # every payload checked before any is unpickled; this rank's too comes from the bytes: a copy, as in mpi4py
        datas = [self._check(bufs[r][:n].numpy().tobytes(), r, call, method) for r, n in enumerate(lengths)]
        return [pickle.loads(d) for d in datas]

    def allgather(self, obj: Any) -> list[Any]:
        return self._allgather(obj, "allgather")

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        values = self._allgather(obj, "gather")
        return values if self._rank == root else None

    def allreduce(self, value: Any, op: Any = MPI.SUM) -> Any:
        if op is MPI.MAX or op == MPI.MAX:
            fold = max
        elif op is MPI.MIN or op == MPI.MIN:
            fold = min
        elif op is MPI.SUM or op == MPI.SUM:
            fold = operator.add
        else:
            raise ValueError(f"GroupComm.allreduce: unsupported op {op!r} (MPI.MAX, MPI.MIN or MPI.SUM)")
        return functools.reduce(fold, self._allgather(value, "allreduce"))

    def bcast(self, obj: Any, root: int = 0) -> Any:
        call = self._next()
        src = self._global(root)
        payload = self._seal(obj, call) if self._rank == root else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=src, group=self._group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        if self._rank == root:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        dist.broadcast(buf, src=src, group=self._group)
        return pickle.loads(self._check(buf.numpy().tobytes(), root, call, "bcast"))

    def barrier(self) -> None:
        self._next()
        dist.barrier(group=self._group)

    def Barrier(self) -> None:  # noqa: N802 (mpi4py's name)
        self.barrier()

    def Ibarrier(self) -> GroupRequest:  # noqa: N802 (mpi4py's name)
        self._next()
        return GroupRequest(dist.barrier(group=self._group, async_op=True))

    def Split(self, color: int, key: int = 0) -> GroupComm:  # noqa: N802 (mpi4py's name)
        """The ranks of the same ``color`` in a group of their own (collective: every rank makes every color's
        group); ranked by rank in this one, not by ``key`` (the trainer's splits pass the rank)."""
        if self._group is not None:
            raise NotImplementedError("GroupComm.Split splits the default group only")
        colors = self.allgather(color)
        mine = None
        for value in sorted(set(colors), key=repr):
            group = dist.new_group([r for r, c in enumerate(colors) if c == value])
            if value == color:
                mine = group
        return GroupComm(mine, self._secret)

    def Free(self) -> None:  # noqa: N802 (mpi4py's name)
        pass  # the group belongs to its maker

    def Abort(self, status: int = 1) -> None:  # noqa: N802 (mpi4py's name)
        abort(status)


class _Done:
    def Test(self) -> bool:  # noqa: N802 (mpi4py's name)
        return True

    def Wait(self) -> None:  # noqa: N802 (mpi4py's name)
        return None


class SoloComm:
    """A world of one: a spare builds its recipe alone (the launch's ranks built theirs before it took a place)."""

    rank, size = 0, 1

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's name)
        return 0

    def Get_size(self) -> int:  # noqa: N802 (mpi4py's name)
        return 1

    def allgather(self, obj: Any) -> list:
        return [obj]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def gather(self, obj: Any, root: int = 0) -> list:
        return [obj]

    def allreduce(self, value: Any, op: Any = MPI.SUM) -> Any:
        return value

    def barrier(self) -> None:
        return None

    Barrier = barrier

    def Ibarrier(self) -> _Done:  # noqa: N802 (mpi4py's name)
        return _Done()

    def Free(self) -> None:  # noqa: N802 (mpi4py's name)
        return None

    def Abort(self, status: int = 1) -> None:  # noqa: N802 (mpi4py's name)
        abort(status)


def abort(status: int) -> None:
    """End this process now with ``status``, its output flushed; an MPI rank ends its whole MPI job."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream must not stop the abort
            stream.flush()
    logging.shutdown()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(status)  # an MPI rank: this ends the whole MPI job
    os._exit(status)
