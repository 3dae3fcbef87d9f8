"""One run, one trainer at a time (hpc/runlock.py): a live holder refuses a second launch with a message naming it;
a holder that is gone (its process ended, its PID reused, its jobs finished) is replaced; a submission's jobs and a
job's continuation take the lock over. Holders are real processes; Slurm's side is pinned in tests/slurm/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace

import pytest

from hpc import runlock
from hpc.runlock import Holder, RunLocked
from rundir import RunDir
from tests.conftest import ROOT

HOLD = """
import sys, time
from pathlib import Path
from hpc import runlock
from rundir import RunDir
rundir = RunDir(Path(sys.argv[1]))
runlock.take(rundir, runlock.this_process("a local launch"))
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def rundir(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.create()
    return run


def test_a_live_process_holds_the_run_until_it_ends(rundir):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(rundir.root)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked) as info:
            runlock.take(rundir, runlock.this_process("a local launch"))
        message = str(info.value)
        assert f"run {rundir.root} is being trained by a local launch {holder.pid} on this host" in message
        with pytest.raises(RunLocked, match=f"a local launch {holder.pid}"):
            runlock.join(rundir, "123")  # a Slurm job of a plain sbatch, too
    finally:
        holder.kill()
        holder.wait()
    mine = runlock.take(rundir, runlock.this_process("a local launch"))  # its holder gone: replaced
    assert json.loads(rundir.lock.read_text())["pid"] == os.getpid()
    runlock.release(rundir, mine)
    assert not rundir.lock.exists()


def test_a_reused_pid_or_a_torn_record_holds_nothing_and_another_host_holds_until_removed(rundir):
    me = runlock.this_process("a local launch")
    rundir.lock.write_text(json.dumps(asdict(replace(me, pid_start="1", token="old"))))  # this PID, another start
    runlock.release(rundir, runlock.take(rundir, me))
    rundir.lock.write_text('{"pid": 12')  # cut short by a crash
    runlock.release(rundir, runlock.take(rundir, me))
    rundir.lock.write_text(json.dumps(asdict(replace(me, host="login2"))))
    with pytest.raises(RunLocked, match=f"a local launch {me.pid} on host login2 .*remove {rundir.lock}"):
        runlock.take(rundir, runlock.this_process("a local launch"))


def test_a_submissions_jobs_and_a_continuation_take_the_lock_over(rundir):
    submission = runlock.take(rundir, runlock.this_process("a submission to Slurm"))
    runlock.join(rundir, "101", submission.token)  # its job started before the submission named it
    runlock.hand_over(rundir, submission, ["101", "102"])
    record = json.loads(rundir.lock.read_text())
    assert record["jobs"] == ["101", "102"] and record["pid"] == 0 and record["token"] == submission.token
    runlock.join(rundir, "102")  # the chain's next link (a requeue of 101 the same)
    runlock.hand_over(rundir, None, ["103"])  # 102 ends for its continuation, which excludes a bad node
    assert json.loads(rundir.lock.read_text())["jobs"] == ["101", "102", "103"]
    runlock.join(rundir, "103")
    runlock.release(rundir, runlock.this_process("x"))  # not the holder: nothing released
    assert rundir.lock.exists()


def test_jobs_whose_state_cannot_be_read_hold_the_run(rundir, monkeypatch):
    """Without a controller to ask (no Slurm here), a run held by jobs is not taken: they may still run."""
    monkeypatch.setenv("PATH", "/nonexistent")  # no squeue, no sacct
    rundir.lock.write_text(json.dumps(asdict(Holder(jobs=("4242",), what="Slurm", time=time.time()))))
    with pytest.raises(RunLocked, match="Slurm job 4242 \\(its state cannot be read: squeue: "):
        runlock.take(rundir, runlock.this_process("a local launch"))
