"""Stop requests from signals. The handler only records the signal; the loop acts at step boundaries."""

from __future__ import annotations

import signal
import threading
from types import FrameType


class StopFlag:
    """Installs handlers for the given signal names (in the main thread) and restores the previous ones."""

    def __init__(self, names: list[str]) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for name in names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:  # the first one says why (the job's signal before the SIGTERM that follows it)
            self.signum = signum  # nothing else: no I/O, no collectives, no pickling in a handler

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
