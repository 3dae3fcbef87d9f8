"""Which rank's process ended first, seen by the local launcher (torch-free, Linux).

When one rank of a local launch dies (killed, crashed, vanished), mpirun ends the others within milliseconds, so
no survivor lives long enough to say who went away. The launcher watches the ranks itself: it finds mpirun's
descendants that carry a rank in their environment (``PMI_RANK`` from MPICH's hydra, ``OMPI_COMM_WORLD_RANK`` from
Open MPI), opens a pidfd for each (readable the moment that process ends, child or not) and notes the order in
which they end. The first one is the launcher's evidence for runconfig/decide.py when the trainer left no
diagnosis of its own.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from pathlib import Path

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
    seen and all have ended, or ``close``. ``ended`` lists (rank, time) in the order they ended."""

    def __init__(self, root: int, world_size: int) -> None:
        self.root, self.world_size = root, world_size
        self.ended: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-watch", daemon=True)
        self._thread.start()

    @property
    def first_ended(self) -> int | None:
        """The rank that ended first, if it ended clearly before the rest (not all in the same instant)."""
        if not self.ended:
            return None
        first_rank, first_time = self.ended[0]
        if len(self.ended) > 1 and self.ended[1][1] - first_time < 1e-4:
            return None  # ended together (a launcher-wide kill): no rank to blame
        return first_rank

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        fds: dict[int, int] = {}  # fd -> rank
        seen: set[int] = set()
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
                elif not fds:
                    return
                if not fds:
                    time.sleep(0.1)
                    continue
                ready, _, _ = select.select(list(fds), [], [], 0.1 if len(seen) < self.world_size else 0.5)
                now = time.monotonic()
                for fd in ready:
                    self.ended.append((fds.pop(fd), now))
                    os.close(fd)
        finally:
            for fd in fds:
                os.close(fd)
