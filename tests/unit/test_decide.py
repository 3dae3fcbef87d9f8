"""The one decision every launcher takes after a launch (runconfig/decide.py), on real run-directory records."""

import dataclasses
import json
import signal
import subprocess
import sys

import pytest

from runconfig import RunDir, dump_yaml, load_config
from runconfig.contract import (
    EVENT_RESTART,
    EVENT_STOPPED,
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    FAILURE_CRASH,
    FAILURE_HANG,
    FAILURE_USER,
    append_event,
)
from runconfig.decide import Situation, decide, record_restart, restarts_so_far
from runconfig.outcome import Ended
from runconfig.rundir import read_jsonl
from tests.conftest import ROOT

SLURM = Situation(slurm=True)
LOCAL = Situation(slurm=False)


@pytest.fixture
def rundir(tmp_path):
    rundir = RunDir(tmp_path / "run")
    rundir.create()
    rundir.config.write_text(dump_yaml(load_config("tiny")))
    return rundir


def job(**changes):
    return dataclasses.replace(load_config("tiny").job, **changes)


@pytest.mark.parametrize(
    "ended,situation,action,status,error",
    [
        (Ended("done", 0), SLURM, "done", EXIT_DONE, False),
        (Ended("stopped", 75, signal.SIGUSR2), LOCAL, "end", EXIT_STOPPED, False),
        (Ended("stopped", 75, signal.SIGUSR2), SLURM, "requeue", EXIT_STOPPED, False),
        (Ended("stopped", 137, signal.SIGTERM, recorded=True), SLURM, "end", EXIT_STOPPED, False),
        (Ended("stopped", 75, signal.SIGUSR2), Situation(slurm=True, last_in_chain=False), "end", EXIT_DONE, False),
        (Ended("stopped", 75, signal.SIGUSR2), Situation(slurm=True, requeues=20), "end", EXIT_STOPPED, True),
        (Ended("stopped", 75, signal.SIGUSR2), Situation(slurm=True, requeues=2, max_requeues=2), "end", 75, True),
    ],
)
def test_after_done_or_a_stop(rundir, ended, situation, action, status, error):
    decision = decide(rundir, job(), ended, situation)
    assert (decision.action, decision.status, decision.error) == (action, status, error), decision


def test_a_paused_run_is_held(rundir):
    rundir.pause_marker.write_text("")
    assert decide(rundir, job(), Ended("stopped", 75, signal.SIGUSR2), SLURM).action == "requeuehold"


def test_failures_restart_with_a_doubling_back_off_up_to_the_cap(rundir):
    cfg = job(max_failures=3, restart_backoff_s=2.0)
    delays = []
    for _ in range(3):
        decision = decide(rundir, cfg, Ended("failed", 137), SLURM)
        assert decision.action == "restart" and "killed by SIGKILL" in decision.cause, decision
        record_restart(rundir, decision, failed_launch="L", status=137)
        delays.append(decision.delay_s)
    assert delays == [2.0, 4.0, 8.0]
    assert [e["attempt"] for e in read_jsonl(rundir.history) if e["event"] == EVENT_RESTART] == [1, 2, 3]
    final = decide(rundir, cfg, Ended("failed", 137), SLURM)
    assert (final.action, final.status, final.error) == ("end", EXIT_FAILED, True)
    assert "3 in-job restarts already" in final.message and "job.max_failures=3" in final.message
    assert restarts_so_far(rundir) == 3


def test_the_trainers_diagnosis_is_the_cause_and_bad_input_is_never_retried(rundir):
    rundir.write_failure(3, "rank 3: a collective failed at step 7", FAILURE_CRASH)
    assert decide(rundir, job(), Ended("failed", 1), LOCAL).cause == "rank 3: a collective failed at step 7"
    rundir.write_failure(1, "rank 1 made no progress for 30 s", FAILURE_HANG)
    assert decide(rundir, job(), Ended("failed", 3), LOCAL).cause.startswith("hang: rank 1 made no progress")
    rundir.write_failure(0, "data.path /x does not exist", FAILURE_USER)
    decision = decide(rundir, job(max_failures=5), Ended("failed", 1), SLURM)
    assert (decision.action, decision.status) == ("end", EXIT_USER_ERROR)
    rundir.failure.unlink()
    assert decide(rundir, job(), Ended("failed", EXIT_USER_ERROR), SLURM).action == "end"  # status 2 alone


def test_restarts_off(rundir):
    decision = decide(rundir, job(max_failures=0), Ended("failed", 1), LOCAL)
    assert decision.action == "end" and "restarts are off" in decision.message


def test_the_sbatch_entry_point_records_the_restart(rundir):
    append_event(rundir.history, EVENT_STOPPED, step=3, launch="other")
    out = subprocess.run(
        [sys.executable, "-m", "runconfig.decide", str(rundir.root), "L1", "137", "--requeues", "0"],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )  # fmt: skip
    first, message = out.stdout.splitlines()
    assert first == "restart 1 5" and "restart 1 of at most 3" in message
    restart = read_jsonl(rundir.history)[-1]
    assert restart["event"] == EVENT_RESTART and restart["launch"] == "L1" and restart["status"] == 137
    out = subprocess.run(
        [sys.executable, "-m", "runconfig.decide", str(rundir.root), "L2", "0", "--local"],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )  # fmt: skip
    assert out.stdout.splitlines()[0] == "done 0 0"
    assert json.loads(rundir.history.read_text().splitlines()[-1])["event"] == EVENT_RESTART  # nothing new
