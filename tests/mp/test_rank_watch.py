"""The local launcher's own evidence of which rank ended first, and its end of a launch whose other ranks live on
(hpc/ranks.py), with real mpirun processes."""

import contextlib
import os
import signal
import subprocess
import time

import pytest

from hpc.procexit import ProcExits
from hpc.ranks import RankWatch
from tests.conftest import PY, mpirun_path

pytestmark = pytest.mark.mp

# Rank ``first`` leaves with status 0 after a moment; the others sleep on. Not MPI processes: mpirun ends all the
# ranks of an MPI job when one leaves without MPI_Finalize, whatever its status, which is what this watch must
# tell apart from the rest; its own mechanics are what is pinned here.
ONE_LEAVES = (
    "import os, time; time.sleep(1.0); "
    "os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK')) == '{first}' and os._exit(0); time.sleep(60)"
)


def start(n: int, first: int) -> subprocess.Popen:
    command = [mpirun_path(), "-n", str(n), PY, "-c", ONE_LEAVES.format(first=first)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped, or no longer there)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return True


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_first_rank_ended_is_named_and_the_rest_are_killed_when_the_grace_ends(monkeypatch):
    # A watch descheduled between two kills (a busy host): hydra ends rank 2 once rank 0 is killed, before its turn.
    send = signal.pidfd_send_signal
    monkeypatch.setattr(signal, "pidfd_send_signal", lambda fd, sig: (send(fd, sig), time.sleep(0.3)))
    proc = start(3, first=1)
    try:
        watch = RankWatch(proc.pid, 3, grace_s=2.0)
        wait_for(lambda: watch.ended)
        time.sleep(0.5)
        assert [r for r, _ in watch.ended] == [1] and watch.killed == [], watch.ended  # the others live on
        proc.wait(timeout=30)
        watch.close()
        assert watch.first_ended == 1, watch.ended
        assert sorted(watch.killed) == [0, 2] and sorted(r for r, _ in watch.ended) == [0, 1, 2]
        assert watch.ended[1][1] - watch.ended[0][1] >= 1.9, watch.ended
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_rest_are_killed_soon_after_the_outcome_is_on_record(tmp_path):
    record = tmp_path / "failure.json"
    proc = start(2, first=0)
    try:
        watch = RankWatch(proc.pid, 2, grace_s=300.0, settled=lambda: 1.0 if record.exists() else None)
        wait_for(lambda: watch.ended)
        time.sleep(0.5)
        assert watch.killed == []  # nothing on record yet: rank 1 lives on
        record.write_text("{}")
        time.sleep(0.5)
        assert watch.killed == []  # the ranks tearing down get the settle time to exit on their own
        proc.wait(timeout=30)
        watch.close()
        assert watch.first_ended == 0 and watch.killed == [1], watch.ended
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ranks_that_end_cleanly_are_not_killed():
    proc = subprocess.Popen([mpirun_path(), "-n", "2", PY, "-c", "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"])
    watch = RankWatch(proc.pid, 2, grace_s=30.0)
    assert proc.wait(timeout=60) == 0
    watch.close()
    assert watch.killed == []


def test_the_kernels_exit_order_stands_where_the_watch_woke_too_late():
    """A busy host can wake the watch once for ranks that ended milliseconds apart; the kernel's exit events
    (hpc/procexit.py: outside a container's pid namespace) keep their order."""
    probe = ProcExits.open()
    if probe is None:
        pytest.skip("no kernel process events here (a container's pid namespace, or Linux < 6.6 without root)")
    probe.close()
    proc = start(3, first=-1)  # nobody leaves on their own
    try:
        watch = RankWatch(proc.pid, 3)
        wait_for(lambda: len(watch.found) == 3)
        for rank in (2, 0, 1):
            with contextlib.suppress(ProcessLookupError):  # mpirun may have ended them already
                os.kill(watch.found[rank], signal.SIGKILL)
            # A signalled process exits when it next runs: on a busy host a later one can run first (a rank
            # killed 5 ms after another once exited 0.45 ms before it). Each exit is awaited before the next kill.
            wait_for(lambda pid=watch.found[rank]: gone(pid), timeout=10.0)
        proc.wait(timeout=30)
        wait_for(lambda: len(watch.ended) == 3)
        watch.close()
        # What a late wake-up records: the three at one instant, in no particular order.
        woke = watch.ended[-1][1]
        watch.ended = [(0, woke), (1, woke), (2, woke)]
        order = watch.order()
        assert order[0][0] == 2 and order[1][1] - order[0][1] >= 1e-4, order  # mpirun may end 0 and 1 itself
        assert watch.first_ended == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
