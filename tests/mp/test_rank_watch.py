"""The local launcher's own evidence of which rank died (hpc/ranks.py), with real mpirun processes."""

import os
import signal
import subprocess
import time

import pytest

from hpc.mpi import find_launcher
from hpc.ranks import RankWatch, find_ranks
from tests.conftest import PY

pytestmark = pytest.mark.mp

# As the trainer does once its config is read (trainer/loop/stop.py): mpirun's SIGUSR1 notice is ignored.
MPI_SLEEPER = (
    "from mpi4py import MPI; import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
    "MPI.COMM_WORLD.Barrier(); print('ready', flush=True); time.sleep(60)"
)


def wait_ready(proc, n):
    """Until every rank is past MPI_Init and a barrier (hydra ends them all when one dies before its PMI start)."""
    seen = ""
    while seen.count("ready") < n:  # the ranks' lines may come through interleaved
        line = proc.stdout.readline()
        assert line, seen
        seen += line


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_rank_is_named_and_the_others_outlive_it_until_the_grace_ends():
    """The survivors are not killed by mpirun within milliseconds (which a late wake-up of the watch on a loaded
    host could not tell apart from all ranks ending at once): they live on, the rank that died is the first one
    ended, and the watch kills the rest once the grace is over."""
    launcher = find_launcher()
    proc = subprocess.Popen(launcher.command(3, [PY, "-c", MPI_SLEEPER]), stdout=subprocess.PIPE, text=True)
    try:
        watch = RankWatch(proc.pid, 3, grace_s=2.0)
        wait_ready(proc, 3)
        wait_for(lambda: len(watch.seen) == 3)
        pids = find_ranks(proc.pid)
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: watch.ended)
        time.sleep(0.5)
        if launcher.flavour == "mpich":
            assert [r for r, _ in watch.ended] == [1], watch.ended  # the others still run
            assert watch.first_ended == 1
        proc.wait(timeout=30)
        watch.close()
        assert watch.first_ended == 1, watch.ended
        assert sorted(r for r, _ in watch.ended) == [0, 1, 2]
        if launcher.flavour == "mpich":
            assert sorted(watch.killed) == [0, 2]
            assert watch.ended[1][1] - watch.ended[0][1] >= 1.9, watch.ended
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ranks_that_end_cleanly_are_not_killed():
    launcher = find_launcher()
    proc = subprocess.Popen(
        launcher.command(2, [PY, "-c", "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"]), stdout=subprocess.PIPE
    )
    watch = RankWatch(proc.pid, 2, grace_s=30.0)
    assert proc.wait(timeout=60) == 0
    watch.close()
    assert watch.killed == []


def test_the_rest_are_killed_soon_after_the_outcome_is_on_record(tmp_path, monkeypatch):
    monkeypatch.setattr(RankWatch, "SETTLE_S", 1.0)
    record = tmp_path / "failure.json"
    launcher = find_launcher()
    proc = subprocess.Popen(launcher.command(2, [PY, "-c", MPI_SLEEPER]), stdout=subprocess.PIPE, text=True)
    try:
        watch = RankWatch(proc.pid, 2, grace_s=300.0, settled=record.exists)
        wait_ready(proc, 2)
        wait_for(lambda: len(watch.seen) == 2)
        os.kill(find_ranks(proc.pid)[0], signal.SIGKILL)
        wait_for(lambda: watch.ended)
        time.sleep(0.5)
        if launcher.flavour == "mpich":
            assert watch.killed == []  # nothing on record yet: rank 1 lives on
            record.write_text("{}")
            time.sleep(0.5)
            assert watch.killed == []  # the ranks tearing down get SETTLE_S to exit on their own
        proc.wait(timeout=30)
        watch.close()
        assert watch.first_ended == 0
        if launcher.flavour == "mpich":
            assert watch.killed == [1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
