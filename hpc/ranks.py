"""Which rank's process ended first, seen by the local launcher (torch-free, Linux), and the end of a launch
whose ranks outlive one that ended.

The launcher watches the ranks itself: it finds mpirun's descendants that carry a rank in their environment
(``PMI_RANK`` from MPICH's hydra, ``OMPI_COMM_WORLD_RANK`` from Open MPI), opens a pidfd for each (readable the
moment that process ends, child or not) and notes the order in which they end. The first one is the launcher's
evidence for hpc/policy/decide.py when the trainer left no diagnosis of its own.

That order is only evidence while the others outlive the first by more than the watch's wake-up time, and hydra by
default kills every rank within milliseconds of one that ended badly. The local launcher therefore runs hydra with
``-disable-auto-cleanup`` (hpc/mpi.py) and ends the launch itself: the survivors see their collective fail, name
the silent rank by a roll call (trainer/observe/watchdog.py), write failure.json and abort the MPI job
(trainer/main.py; in that order, since hydra also ends every rank as soon as one writes to stdout or stderr after a
rank died); ranks still running ``grace_s`` after the first one ended (blocked in MPI, say), or once the failure is
on record, are killed here. That narrows the race without closing it: hydra still ends every rank when a killed
rank's PMI connection closes before MPI_Finalize (docs/measurements/notes-login-side.md). Where the kernel's
process-exit events are readable (hpc/procexit.py), the order comes from their timestamps, which a late wake-up
does not lose; elsewhere from the wake-ups. (Open MPI's mpirun keeps its own clean-up; best effort there.)
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hpc.procexit import ProcExits

RANK_VARS = (b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(x) for x in task.read_text().split()]
    return out


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in environ.split(b"\0"):
        for var in RANK_VARS:
            if item.startswith(var) and item[len(var) :].isdigit():
                return int(item[len(var) :])
    return None


def find_ranks(root: int) -> dict[int, int]:
    """{rank: pid} of the processes under ``root`` that carry an MPI rank (the first one found per rank: a
    rank's own children inherit its environment)."""
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop(0)
        rank = _rank_of(pid) if pid != root else None
        if rank is not None and rank not in found:
            found[rank] = pid
            continue
        todo += _children(pid)
    return found


class RankWatch:
    """Watches the ranks under ``root`` (the mpirun process) from a daemon thread until ``world_size`` of them are
    seen and all have ended, or ``close``. ``ended`` lists (rank, time) in the order they ended. With ``grace_s``,
    the ranks still running that long after one ended are killed (``killed`` lists them), or sooner: once
    ``settled()`` says the launch's outcome is recorded (the diagnosis is in), it returns how many seconds the ranks
    still running get to end on their own (``SETTLE_S``: those only tearing down, e.g. after a bad-input error, exit
    meanwhile with their own status; after a hang the live ranks end right after the report, and the rest are hung);
    None before."""

    SETTLE_S = 10.0

    def __init__(
        self,
        root: int,
        world_size: int,
        grace_s: float | None = None,
        settled: Callable[[], float | None] | None = None,
    ) -> None:
        self.root, self.world_size, self.grace_s, self.settled = root, world_size, grace_s, settled
        self.ended: list[tuple[int, float]] = []
        self.killed: list[int] = []
        self.seen: set[int] = set()  # the ranks found (a pidfd open for each)
        self.found: dict[int, int] = {}  # rank -> pid
        # Opened before any rank can end (mpirun was just started): the kernel's exit events, where readable.
        self.exits = ProcExits.open()
        self._started = time.monotonic()  # a rank's exit is later (its pid may have served an earlier process)
        self._settled_at: float | None = None
        self._settle_s = self.SETTLE_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-watch", daemon=True)
        self._thread.start()

    @property
    def first_ended(self) -> int | None:
        """The rank that ended first, if it ended clearly before the rest (not all in the same instant)."""
        order = self.order()
        if not order:
            return None
        first_rank, first_time = order[0]
        if len(order) > 1 and order[1][1] - first_time < 1e-4:
            return None  # ended together (a launcher-wide kill): no rank to blame
        return first_rank

    def order(self) -> list[tuple[int, float]]:
        """(rank, time) of the ranks that ended, first first: by the kernel's exit timestamps where it gave one for
        every such rank, else by when the watch saw them end."""
        ended = list(self.ended)
        if self.exits is not None and self.exits.lossless and ended:
            exits = [self.exits.exited(self.found[rank], self._started) for rank, _ in ended]
            if all(e is not None for e in exits):
                return sorted(((rank, e[0]) for (rank, _), e in zip(ended, exits, strict=True)), key=lambda x: x[1])
        return ended

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.exits is not None:
            self.exits.drain(set(self.found.values()))
            self.exits.close()  # what it read stays: order() needs no socket

    def _run(self) -> None:
        fds: dict[int, int] = {}  # fd -> rank
        seen = self.seen
        try:
            while not self._stop.is_set():
                if len(seen) < self.world_size:
                    for rank, pid in find_ranks(self.root).items():
                        if rank in seen:
                            continue
                        try:
                            fds[os.pidfd_open(pid)] = rank
                        except OSError:
                            continue
                        seen.add(rank)
                        self.found[rank] = pid
                elif not fds:
                    return
                if not fds:
                    time.sleep(0.1)
                    continue
                wait = 0.1 if len(seen) < self.world_size else 0.5
                if self.ended and self.grace_s is not None:
                    now = time.monotonic()
                    if self._settled_at is None and self.settled is not None:
                        settle_s = self.settled()
                        if settle_s is not None:
                            self._settled_at, self._settle_s = now, settle_s
                    left = self.ended[0][1] + self.grace_s - now
                    if self._settled_at is not None:
                        left = min(left, self._settled_at + self._settle_s - now)
                    if left <= 0 and not self.killed:
                        self._kill(fds)
                    wait = min(wait, max(left, 0.05))
                ready, _, _ = select.select(list(fds), [], [], wait)
                now = time.monotonic()
                if self.exits is not None:  # keep the kernel's queue short; once every rank is known, only theirs
                    self.exits.drain(set(self.found.values()) if len(seen) == self.world_size else None)
                for fd in ready:
                    self.ended.append((fds.pop(fd), now))
                    os.close(fd)
        finally:
            for fd in fds:
                os.close(fd)

    def _kill(self, fds: dict[int, int]) -> None:
        """SIGKILL the ranks still running (through their pidfds: never a recycled pid). All of them are listed in
        ``killed``: hydra ends the rest of a launch once one is killed, so a later one may be gone before its turn."""
        for fd, rank in fds.items():
            self.killed.append(rank)
            with contextlib.suppress(OSError):  # gone already (ProcessLookupError)
                signal.pidfd_send_signal(fd, signal.SIGKILL)
