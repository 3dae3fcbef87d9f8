"""Stop requests from signals. The handler only records the signal; the loop acts at step boundaries."""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType

# Signals a run may be stopped with whose default action ends the process (SIGINT stays an interrupt until the
# config is read; SIGCONT's default is harmless).
EARLY_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGHUP", "SIGXCPU")
# Not stop signals unless configured so, yet never fatal: MPICH's mpirun sends SIGUSR1 to the surviving ranks when
# one ended badly (the local launcher runs it with -disable-auto-cleanup and ends the launch itself after the
# survivors named the rank that went away: hpc/ranks.py); NCCL uses it on some systems.
NOTICE_SIGNALS = ("SIGUSR1",)


class EarlySignals:
    """From the first lines of the process until the config says which signals stop the run: each of
    ``EARLY_SIGNALS`` is recorded instead of ending the process (a preemption during the imports or MPI_Init must be
    a clean stop, not a dead rank). ``StopFlag`` takes the first one over."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None  # when it arrived (time.time())
        self.installed: dict[int, object] = {}  # the handlers before these: SIG_IGN where ignored at exec
        if threading.current_thread() is threading.main_thread():
            for name in EARLY_SIGNALS:
                signum = getattr(signal, name)
                self.installed[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.time()


class StopFlag:
    """Installs handlers for the given signal names (in the main thread) and restores the previous ones.

    ``early``: the handlers installed at process start; a configured stop signal they recorded counts as requested,
    and the early signals that are not stop signals get their previous handlers back."""

    def __init__(self, names: list[str], early: EarlySignals | None = None) -> None:
        self.signum: int | None = None
        self.at: float | None = None  # when this process received it (time.time(), read in the handler)
        self.ignored_early: int | None = None  # an early signal that is not a stop signal (it was not fatal)
        self._previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        wanted = {getattr(signal, name) for name in names}
        for signum in wanted:
            previous = signal.signal(signum, self._handle)
            if early is not None and signum in early.installed:
                previous = early.installed[signum]
            self._previous[signum] = previous
        if early is not None:
            for signum, previous in early.installed.items():
                if signum in wanted:
                    continue
                if signal.Signals(signum).name in NOTICE_SIGNALS:
                    # Ignored, not the previous handler back: that may be the default action, which ends the
                    # process (MPI_Init's own handler was replaced by the early one). Ignored rather than caught:
                    # the interpreter puts the default action back on its way out for any handler but SIG_IGN, and
                    # a rank still tearing down must not die of a notice.
                    signal.signal(signum, signal.SIG_IGN)
                    self._previous[signum] = previous
                else:
                    signal.signal(signum, previous)
            if early.signum is not None:
                if early.signum in wanted:
                    self.signum, self.at = early.signum, early.at
                else:
                    self.ignored_early = early.signum

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:  # the first one says why (the job's signal before the SIGTERM that follows it)
            self.signum, self.at = signum, time.time()  # nothing else: no I/O, no collectives, no pickling

    def catches(self, signum: int) -> bool:
        return signum in self._previous and signal.getsignal(signum) == self._handle

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def ignore_stop_signals() -> None:
    """From here to the process's exit, the signals of ``EARLY_SIGNALS`` are ignored: the run's outcome is decided
    and recorded, and the interpreter's own exit would put their default action (ending the process) back, turning
    a late stop signal, or mpirun's notice that another rank ended (SIGUSR1), into a death by signal."""
    if threading.current_thread() is threading.main_thread():
        for name in EARLY_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
