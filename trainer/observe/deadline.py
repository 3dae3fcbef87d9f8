"""The start-up deadline (``monitor.startup_timeout_s``). A rank whose start-up hangs before the rendezvous
completes is never seen by the hang watchdog, which starts later: imports on a stalled file system, MPI_Init, the
TCPStore, init_process_group. faulthandler's own C thread watches it instead. It fires whatever the main thread
holds: mpi4py runs MPI_Init with the GIL held, and a rendezvous blocks in C++. When the deadline passes, it writes
``Timeout (H:MM:SS)!`` and every thread's Python stack to the rank's log (stderr before the log is open), then
exits with status 1: the launch fails and is restarted like a crash."""

from __future__ import annotations

import contextlib
import faulthandler
import sys
import time
from typing import IO

EARLY_S = 1800.0  # before the config is read: the imports and MPI_Init, on any file system


class StartupDeadline:
    def __init__(self, process_start: float) -> None:
        self.process_start = process_start
        self._file: IO[str] | None = None
        self._arm(EARLY_S, sys.stderr)

    def limit(self, seconds: float, log_path=None) -> None:
        """The run's limit from the process's start (0: none); the dump goes to ``log_path`` once it is known."""
        if not seconds:
            self.end()
            return
        file = sys.stderr
        if log_path is not None:
            with contextlib.suppress(OSError):
                file = open(log_path, "a")  # noqa: SIM115 (kept open for faulthandler's thread; closed in end())
        self._arm(seconds, file)

    def end(self) -> None:
        """Start-up is over (the rendezvous completed): the hang watchdog takes over."""
        faulthandler.cancel_dump_traceback_later()
        self._close()

    def _arm(self, seconds: float, file: IO[str]) -> None:
        faulthandler.cancel_dump_traceback_later()
        self._close()
        if file is not sys.stderr:
            self._file = file
        left = max(1.0, self.process_start + seconds - time.time())
        faulthandler.dump_traceback_later(left, exit=True, file=file)

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
