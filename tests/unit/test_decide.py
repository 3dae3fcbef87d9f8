"""The one decision every launcher takes after a launch (hpc/policy/decide.py), on real run-directory records."""

import dataclasses
import json
import signal
import subprocess
import sys
import time

import pytest

from hpc.policy.decide import Situation, decide_after_launch, record_decision, restarts_so_far
from hpc.policy.outcome import Ended
from runconfig import dump_yaml, load_config
from rundir import RunDir
from rundir.contract import (
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
from rundir.paths import read_jsonl
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
    decision = decide_after_launch(rundir, job(), ended, situation)
    assert (decision.action, decision.status, decision.error) == (action, status, error), decision


def test_a_paused_run_is_held(rundir):
    rundir.pause_marker.write_text("")
    assert decide_after_launch(rundir, job(), Ended("stopped", 75, signal.SIGUSR2), SLURM).action == "requeuehold"


def test_failures_restart_with_a_doubling_back_off_up_to_the_cap(rundir):
    cfg = job(max_failures=3, restart_backoff_s=2.0)
    delays = []
    for _ in range(3):
        decision = decide_after_launch(rundir, cfg, Ended("failed", 137), SLURM)
        assert decision.action == "restart" and "killed by SIGKILL" in decision.cause, decision
        record_decision(rundir, decision, failed_launch="L", status=137)
        delays.append(decision.delay_s)
    assert delays == [2.0, 4.0, 8.0]
    assert [e["attempt"] for e in read_jsonl(rundir.history) if e["event"] == EVENT_RESTART] == [1, 2, 3]
    final = decide_after_launch(rundir, cfg, Ended("failed", 137), SLURM)
    assert (final.action, final.status, final.error) == ("end", EXIT_FAILED, True)
    assert "3 in-job restarts already" in final.message and "job.max_failures=3" in final.message
    assert restarts_so_far(rundir) == 3


def test_the_trainers_diagnosis_is_the_cause_and_bad_input_is_never_retried(rundir):
    rundir.write_failure(3, "rank 3: a collective failed at step 7", FAILURE_CRASH)
    assert (
        decide_after_launch(rundir, job(), Ended("failed", 1), LOCAL).cause == "rank 3: a collective failed at step 7"
    )
    rundir.clear_failure()  # each as a new launch
    rundir.write_failure(1, "rank 1 made no progress for 30 s", FAILURE_HANG)
    assert decide_after_launch(rundir, job(), Ended("failed", 3), LOCAL).cause.startswith(
        "hang: rank 1 made no progress"
    )
    rundir.clear_failure()
    rundir.write_failure(0, "data.path /x does not exist", FAILURE_USER)
    decision = decide_after_launch(rundir, job(max_failures=5), Ended("failed", 1), SLURM)
    assert (decision.action, decision.status) == ("end", EXIT_USER_ERROR)
    rundir.failure.unlink()
    assert decide_after_launch(rundir, job(), Ended("failed", EXIT_USER_ERROR), SLURM).action == "end"  # status 2 alone


def test_restarts_off(rundir):
    decision = decide_after_launch(rundir, job(max_failures=0), Ended("failed", 1), LOCAL)
    assert decision.action == "end" and "restarts are off" in decision.message


def test_the_sbatch_entry_point_records_the_restart(rundir):
    append_event(rundir.history, EVENT_STOPPED, step=3, launch="other")
    out = subprocess.run(
        [sys.executable, "-m", "hpc.policy.decide", str(rundir.root), "L1", "137", "--requeues", "0"],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )  # fmt: skip
    first, message, nodes, exclude = out.stdout.splitlines()
    assert first == "restart 1 5" and "restart 1 of at most 3" in message and nodes == exclude == "-"
    restart = read_jsonl(rundir.history)[-1]
    assert restart["event"] == EVENT_RESTART and restart["launch"] == "L1" and restart["status"] == 137
    out = subprocess.run(
        [sys.executable, "-m", "hpc.policy.decide", str(rundir.root), "L2", "0", "--local"],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )  # fmt: skip
    assert out.stdout.splitlines()[0] == "done 0 0"
    assert json.loads(rundir.history.read_text().splitlines()[-1])["event"] == EVENT_RESTART  # nothing new


def suspect(rank, node, why="stopped publishing heartbeats"):
    return {"rank": rank, "node": node, "node_index": rank // 2, "why": why}


ALLOC = ("n1", "n2", "n3", "n4")


def test_a_failed_nodes_ranks_shrink_the_run_in_the_job_when_min_nodes_allows(rundir):
    rundir.write_failure(0, "rank 0: a collective failed at step 7", FAILURE_CRASH, [suspect(5, "n3")])
    situation = Situation(slurm=True, nodes=ALLOC, launch_nodes=ALLOC, ranks_per_node=2)
    decision = decide_after_launch(rundir, job(nodes=4, min_nodes=2), Ended("failed", 1), situation)
    assert decision.action == "restart" and decision.use_nodes == ("n1", "n2", "n4"), decision
    assert decision.new_bad[0][0] == "n3" and "rank 5" in decision.new_bad[0][1]
    assert "on 3 of 4 nodes" in decision.message and "n3 left out" in decision.message
    record_decision(rundir, decision, failed_launch="L1", status=1)
    events = read_jsonl(rundir.history)
    assert [e["event"] for e in events] == ["bad_node", EVENT_RESTART]
    assert events[0]["node"] == "n3" and events[1]["nodes"] == ["n1", "n2", "n4"] and events[1]["excluded"] == ["n3"]
    # The next failure names n1, by the launcher's evidence only (srun's first failed task): 2 nodes left.
    rundir.failure.unlink()
    situation = Situation(slurm=True, nodes=ALLOC, launch_nodes=("n1", "n2", "n4"), ranks_per_node=2, first_ended=1)
    decision = decide_after_launch(rundir, job(nodes=4, min_nodes=2), Ended("failed", 137), situation)
    assert decision.use_nodes == ("n2", "n4") and decision.exclude == ("n3", "n1"), decision
    assert "ended first" in decision.new_bad[0][1]
    record_decision(rundir, decision, failed_launch="L2", status=137)
    # A third: below min_nodes, so the run continues in a new job excluding all three.
    situation = Situation(slurm=True, nodes=ALLOC, launch_nodes=("n2", "n4"), ranks_per_node=2, first_ended=3)
    decision = decide_after_launch(rundir, job(nodes=4, min_nodes=2), Ended("failed", 137), situation)
    assert decision.action == "resubmit" and decision.exclude == ("n3", "n1", "n4"), decision
    assert decision.attempt == 3


def test_a_bad_node_due_back_rejoins_the_restart_and_is_taken_back_when_recorded(rundir):
    """job.retake_nodes_after_s: a node named long enough ago is not bad for the decision (the restart grows back
    onto it); record_decision writes its node_back event. (Locally: under Slurm its verdict on the node is asked
    too, which tests/unit/test_badnodes.py pins.)"""
    append_event(rundir.history, "bad_node", node="n3", reason="x", evidence="y", launch="L0")
    rundir.write_failure(0, "rank 0: a collective failed at step 7", FAILURE_CRASH, [])
    situation = Situation(slurm=False, nodes=ALLOC, launch_nodes=("n1", "n2", "n4"), ranks_per_node=2)
    kept = decide_after_launch(rundir, job(nodes=4, min_nodes=2), Ended("failed", 1), situation)
    assert kept.use_nodes == ("n1", "n2", "n4") and kept.exclude == ("n3",) and not kept.taken_back, kept
    time.sleep(0.05)
    decision = decide_after_launch(
        rundir, job(nodes=4, min_nodes=2, retake_nodes_after_s=0.01), Ended("failed", 1), situation
    )
    assert decision.action == "restart" and decision.use_nodes == ALLOC and decision.exclude == (), decision
    assert [n for n, _, _ in decision.taken_back] == ["n3"] and "n3 taken back" in decision.message
    assert read_jsonl(rundir.history)[-1]["event"] == "bad_node"  # decide itself writes nothing
    record_decision(rundir, decision, failed_launch="L1", status=1)
    events = read_jsonl(rundir.history)
    assert [e["event"] for e in events] == ["bad_node", "node_back", EVENT_RESTART], events
    assert events[1]["how"] == "after job.retake_nodes_after_s=0.01" and events[2]["nodes"] == list(ALLOC)


def test_without_min_nodes_a_slurm_run_moves_to_a_new_job_and_a_local_one_restarts_in_place(rundir):
    rundir.write_failure(1, "hang: ...", FAILURE_HANG, [suspect(2, "n2")])
    slurm = Situation(slurm=True, nodes=("n1", "n2"), launch_nodes=("n1", "n2"), ranks_per_node=2)
    decision = decide_after_launch(rundir, job(nodes=2), Ended("failed", 3), slurm)
    assert decision.action == "resubmit" and decision.exclude == ("n2",) and decision.status == EXIT_FAILED
    local = Situation(slurm=False, nodes=("node0", "node1"), launch_nodes=("node0", "node1"), ranks_per_node=2)
    decision = decide_after_launch(rundir, job(nodes=2), Ended("failed", 3), local)
    assert decision.action == "restart" and decision.use_nodes == ("node0", "node1") and not decision.new_bad
    # Named nodes are not left out when the user turned it off.
    decision = decide_after_launch(rundir, job(nodes=2, exclude_bad_nodes=False), Ended("failed", 3), slurm)
    assert decision.action == "restart" and not decision.new_bad


def test_a_stop_of_a_run_with_bad_nodes_is_resubmitted_not_requeued(rundir):
    append_event(rundir.history, "bad_node", node="n2", reason="x", evidence="y", launch="L0")
    decision = decide_after_launch(rundir, job(), Ended("stopped", 75, signal.SIGUSR2), SLURM)
    assert decision.action == "resubmit" and decision.exclude == ("n2",) and decision.status == EXIT_STOPPED


@pytest.mark.parametrize(
    "changes,key",
    [
        ({"job.min_nodes": 3}, "job.min_nodes"),  # more than job.nodes
        ({"job.min_nodes": 1, "job.max_failures": 0}, "job.min_nodes"),
        ({"job.nodes": 3, "job.min_nodes": 2, "train.global_batch_size": 6, "train.micro_batch_size": 1}, "on 2 node"),
    ],
)
def test_min_nodes_is_checked_against_the_job_shape(changes, key):
    from runconfig import ConfigError

    sets = [f"{k}={v}" for k, v in {"job.nodes": 2, "job.ranks_per_node": 2, **changes}.items()]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as caught:
        load_config("tiny", sets)
    assert "job.min_nodes" in str(caught.value)


def test_ranks_ended_with_the_job_are_not_restarted_and_name_no_node(rundir):
    """scancel or the time limit SIGKILLs ranks slow to stop: the driver got SIGTERM too, so nothing restarts."""
    situation = Situation(slurm=True, ending=True, nodes=("n1",), launch_nodes=("n1",), ranks_per_node=1, first_ended=0)
    decision = decide_after_launch(rundir, job(nodes=1), Ended("failed", 137), situation)
    assert decision.action == "end" and not decision.new_bad and "while Slurm was ending the job" in decision.message


def other_sign(situation):
    return dataclasses.replace(situation, stop_signal=False)


@pytest.mark.parametrize(
    "status,seen",
    [(128 + signal.SIGUSR2, False), (-signal.SIGUSR1, False), (137, True)],
)
def test_a_rank_the_stop_signal_killed_before_its_handler_is_a_stop_not_a_bad_node(rundir, status, seen):
    """Slurm's time-limit signal reaches a rank still starting Python (default action: exit): its process ends
    first, but the node did nothing wrong. Known from the exit status, or from the launcher's own receipt."""
    alloc = ("n1", "n2", "n3", "n4")
    situation = Situation(
        slurm=True, nodes=alloc, launch_nodes=alloc, ranks_per_node=1, first_ended=2, stop_signal=seen
    )
    decision = decide_after_launch(rundir, job(nodes=4), Ended("failed", status), situation)
    assert decision.action == "requeue" and not decision.new_bad and not decision.exclude, decision
    assert "before a rank could handle it" in decision.message
    chain = dataclasses.replace(situation, last_in_chain=False)
    decision = decide_after_launch(rundir, job(nodes=4), Ended("failed", status), chain)
    assert decision.action == "end" and decision.status == EXIT_DONE and not decision.new_bad, decision
    # The job's own stop signal, when it is another one (job.signal: SIGHUP), is known from the status too.
    decision = decide_after_launch(
        rundir, job(nodes=4, signal="SIGHUP"), Ended("failed", 128 + signal.SIGHUP), other_sign(situation)
    )
    assert decision.action == "requeue" and not decision.new_bad, decision
    # Without either sign, the same failure names the node of the rank that ended first.
    other = dataclasses.replace(situation, stop_signal=False)
    decision = decide_after_launch(rundir, job(nodes=4), Ended("failed", 137), other)
    assert decision.new_bad and decision.new_bad[0][0] == "n3", decision


def test_the_first_failure_record_stays_whole_and_a_new_launch_clears_it(tmp_path):
    """Several ranks may report at once and one may be killed mid-write (the job aborted): the launcher reads the
    old record or a new one, never a torn one; what a killed writer left is removed with the record."""
    rundir = RunDir(tmp_path)
    rundir.write_failure(0, "hang: rank 2 stopped", "hang", [{"rank": 2, "node": "n1", "why": "silent"}])
    (tmp_path / ".failure.json.tmp-4242").write_text('{"rank": 3, "mess')  # a writer killed mid-write
    rundir.write_failure(1, "rank 1: a collective failed", "crash")  # a consequence: the first record stays
    assert rundir.failure_record()["kind"] == "hang" and rundir.failure_record()["suspects"][0]["rank"] == 2
    rundir.clear_failure()
    assert rundir.failure_record() == {} and not list(tmp_path.glob(".failure*"))
