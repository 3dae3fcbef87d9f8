"""Where a launch's start-up goes: the moment each phase ended, and the peak memory at the marks that matter, for
the launch's start or resume event (``startup_s``, ``peak_mem_mb``)."""

from __future__ import annotations

import time


class StartupClock:
    """Phases end in order: imports (the slowest rank's, measured from the process's start), mpi, rendezvous,
    recipe, build, restore, preflight. Times are rank 0's clock; memory is noted per rank and reduced to the
    largest rank's by the caller."""

    def __init__(self, process_start: float) -> None:
        self.process_start = process_start
        self.ends: dict[str, float] = {"imports": time.time()}
        self.slowest_imports = self.ends["imports"] - process_start
        self.memory_mb: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """``phase`` ended now."""
        self.ends[phase] = time.time()

    def note_memory(self, when: str, mb: float) -> None:
        self.memory_mb[when] = mb

    def phases(self) -> dict[str, float]:
        """Seconds per phase, each from the end of the one before (the imports: the slowest rank's)."""
        out = {"imports": round(self.slowest_imports, 3)}
        names, times = list(self.ends), list(self.ends.values())
        for name, before, after in zip(names[1:], times, times[1:], strict=False):
            out[name] = round(after - before, 3)
        return out
