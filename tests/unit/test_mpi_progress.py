"""The MPI progress thread: every 5 ms outside the loop, rarely while it trains, and it ends at once (real MPI,
a real thread; the probes counted)."""

import time

from mpi4py import MPI

from trainer.parallel.mpi_progress import INTERVAL_S, RELAXED_INTERVAL_S, ProgressThread


class CountingComm:
    def __init__(self, comm: MPI.Comm) -> None:
        self.comm, self.probes = comm, []

    def Iprobe(self, *args) -> bool:  # noqa: N802 (MPI's name)
        self.probes.append(time.monotonic())
        return self.comm.Iprobe(*args)


def probes_in(counting: CountingComm, seconds: float) -> int:
    before = len(counting.probes)
    time.sleep(seconds)
    return len(counting.probes) - before


def test_relaxed_while_training_then_back_and_stop_at_once():
    assert RELAXED_INTERVAL_S >= 10 * INTERVAL_S
    progress = ProgressThread(MPI.COMM_WORLD)
    counting = progress._comm = CountingComm(progress._comm)
    progress._thread.start()
    try:
        assert probes_in(counting, 0.5) >= 8  # ~100 at 5 ms, 17 on a loaded 2-core host; relaxed: ~1
        with progress.relaxed(interval_s=0.4):
            assert progress.interval_s == 0.4
            time.sleep(0.1)  # the wait begun at 5 ms ends
            assert probes_in(counting, 1.0) <= 4  # ~2-3 at 0.4 s
            left = time.monotonic()
        assert progress.interval_s == INTERVAL_S
        time.sleep(0.2)
        assert [t for t in counting.probes if t > left][0] - left < 0.1  # probes at once, not after 0.4 s
        assert probes_in(counting, 0.5) >= 8
        with progress.relaxed(interval_s=30.0):
            time.sleep(0.1)
            started = time.monotonic()
            progress.stop()
            assert time.monotonic() - started < 1.0  # not the 30-s wait
    finally:
        progress.stop()
    assert not progress._thread.is_alive()
