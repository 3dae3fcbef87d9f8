"""Stop requests from signals (trainer/loop/stop.py), in this process."""

import os
import signal
import time

from trainer.loop.stop import EarlySignals, StopFlag, ignore_stop_signals


def wait_for(predicate):
    deadline = time.monotonic() + 5
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_sigusr1_not_a_stop_signal_is_a_notice_not_the_end_of_the_process():
    """mpirun (hydra, auto-cleanup off) sends SIGUSR1 to the survivors of a rank that ended badly: they must live on
    to name it. A stop signal still stops; the handlers before are back after ``restore``."""
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)}
    early = EarlySignals()
    stop = StopFlag(["SIGUSR2", "SIGTERM"], early=early)
    try:
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN  # ignored: kept through the interpreter's exit
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert not stop.requested
        assert signal.getsignal(signal.SIGHUP) is before[signal.SIGHUP]  # not a notice: its earlier handler back
        os.kill(os.getpid(), signal.SIGUSR2)
        assert wait_for(lambda: stop.requested) and stop.signum == signal.SIGUSR2
    finally:
        stop.restore()
    assert {s: signal.getsignal(s) for s in before} == before


def test_sigusr1_as_a_stop_signal_stops():
    stop = StopFlag(["SIGUSR1"], early=EarlySignals())
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(lambda: stop.requested) and stop.signum == signal.SIGUSR1
    finally:
        stop.restore()


def test_on_the_way_out_stop_signals_and_notices_are_ignored():
    """After main() returned, a late stop signal or mpirun's notice must not make the exit a death by signal."""
    names = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGHUP", "SIGXCPU")
    before = {n: signal.getsignal(getattr(signal, n)) for n in names}
    try:
        ignore_stop_signals()
        assert all(signal.getsignal(getattr(signal, n)) is signal.SIG_IGN for n in names)
        os.kill(os.getpid(), signal.SIGTERM)  # would end this test process otherwise
    finally:
        for n, handler in before.items():
            signal.signal(getattr(signal, n), handler)
