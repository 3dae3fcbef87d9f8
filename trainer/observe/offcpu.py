"""How long a thread has slept: wall time minus the time it ran or waited to run, from the kernel's per-thread
scheduler statistics (``/proc/<pid>/task/<tid>/schedstat``: nanoseconds on a CPU, nanoseconds runnable on a run
queue). A training thread sleeps in a step only when it waits for something: on CPU, a collective's completion.
Unlike wall time this leaves out the time a busy host kept the thread off a core while it could run, so on an
oversubscribed node (several ranks per core in tests) it is still the wait for communication, not the contention.
"""

from __future__ import annotations

import os
import threading
import time


class SleepClock:
    """Seconds the thread that built it has slept, as a running total (differences are what count). Unavailable
    (``available`` False) where the kernel has no schedstat: then ``now`` is always 0."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        try:
            self._fd: int | None = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
            self.now()
        except (OSError, ValueError, IndexError):
            self._fd = None

    @property
    def available(self) -> bool:
        return self._fd is not None

    def now(self) -> float:
        if self._fd is None:
            return 0.0
        wall = time.monotonic_ns()
        ran, runnable = os.pread(self._fd, 128, 0).split()[:2]
        return (wall - int(ran) - int(runnable)) / 1e9

    def waited(self) -> float:
        """Seconds the thread has been ready to run but waited for a core (its run-queue time), as a running total:
        more than nothing where more threads are busy than the node has cores. 0 where unavailable."""
        return 0.0 if self._fd is None else int(os.pread(self._fd, 128, 0).split()[1]) / 1e9

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
