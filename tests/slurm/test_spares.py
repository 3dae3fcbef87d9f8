"""In-process restarts under Slurm (job.spare_ranks) on the cluster of separate hosts (tests/slurm/conftest.py's
hosts_cluster): the ranks are srun tasks with no MPI plugin, the keeper runs on the batch host and each warm spare is
an srun step on one of the job's nodes. A task's death ends neither the step nor the others: the spare takes its place
over the network, in the same launch of the same job."""

import json
import os
import signal
import subprocess

import pytest

from rundir.paths import read_jsonl
from tests.conftest import history, rank_pids, summary
from tests.slurm.conftest import TWO_NODES, job_log, sets_for, submit, wait_state, wait_step
from tests.slurm.test_badnodes import assert_separate_hosts, node_lost

pytestmark = pytest.mark.slurm


def test_a_killed_task_is_replaced_by_a_spare_on_another_host_in_the_same_step(
    on_hosts, small_dataset, reference_2x1, tmp_path
):
    """2 nodes x 1 rank, 1 spare, memory checkpoints every step: rank 1 (on n2) SIGKILLed after step 12. The spare,
    an srun step on n2, takes its place; rank 0 on n1 stays in its process and reaches the keeper on n1's address
    from another network; both go on from node memory in the same launch, and the job ends bit-identical to the
    uninterrupted run with no restart, no bad node, and no keeper or spare left."""
    run_dir = tmp_path / "run"
    sets = [*sets_for(small_dataset), *TWO_NODES, "checkpoint.memory_every_steps=1", "job.spare_ranks=1"]
    job_id = submit(run_dir, sets)
    wait_step(run_dir, 12)
    pids = rank_pids(run_dir)
    assert_separate_hosts(run_dir, pids, 1)
    survivor = pids[0]
    os.kill(pids[1], signal.SIGKILL)
    wait_step(run_dir, 20)  # after the rejoin: rank 0 is the same process
    assert rank_pids(run_dir).get(0) == survivor, (survivor, rank_pids(run_dir))
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    log = job_log(run_dir, job_id)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}"
    events = history(run_dir)
    (rejoin,) = [e for e in events if e["event"] == "rejoin"]
    assert rejoin["dead"] == [1] and rejoin["spares"] == {"1": 0} and rejoin["joined_s"] < 10, rejoin
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["launch"] == rejoin["launch"], resumes
    assert resumes[0]["restored_from"]["from"] == "memory" and resumes[0]["step"] >= 11, resumes[0]
    assert not [e for e in events if e["event"] in ("restart", "bad_node", "hang")], events
    assert len((run_dir / "jobs.jsonl").read_text().splitlines()) == 1
    took = (run_dir / "logs" / "rank_00001.log").read_text()  # the spare logs as the rank it replaces
    assert "spare 0 takes rank 1's place in generation 1" in took, took
    assert "waitForInput" not in log + took, "timed waits in the store fill the output with warnings"
    assert "n2: task 1: Killed" in log, log  # srun saw the task die, and went on
    assert summary(run_dir)["params_sha256"] == reference_2x1
    left = subprocess.run(["pgrep", "-af", f"keeper|--run-dir {run_dir}"], capture_output=True, text=True).stdout
    assert str(run_dir) not in left, left  # its keeper and spares (another test's may run beside it)
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 60


def test_a_lost_node_is_replaced_by_a_spare_on_another_node_in_the_same_step(on_hosts, small_dataset, tmp_path):
    """3 nodes x 1 rank, 1 spare (an srun step on n3), the allocation kept (job.no_kill): n2 is lost with its link, so
    no socket of its ever closes. The keeper counts rank 1 dead once it is unheard for monitor.peer_timeout_s, and
    places the spare of n3; the survivors cut their connections to n2's address, and all three go on from node memory
    (n2's files from its partner's copies) in the same launch, the world and the batch unchanged. n2 is named a bad
    node for later launches."""
    run_dir = tmp_path / "run"
    shape = ["job.nodes=3", "job.ranks_per_node=1", "job.no_kill=true", "job.spare_ranks=1"]
    batch = ["train.global_batch_size=24", "train.micro_batch_size=4", "train.steps=80"]
    watch = ["monitor.peer_timeout_s=6", "monitor.heartbeat_s=1", "checkpoint.memory_every_steps=1"]
    job_id = submit(run_dir, [*sets_for(small_dataset), *shape, *batch, *watch])
    wait_step(run_dir, 12)
    pids = rank_pids(run_dir)
    with node_lost(on_hosts, "n2") as lost:
        wait_step(run_dir, 30, timeout=120)
        assert {r: rank_pids(run_dir).get(r) for r in (0, 2)} == {0: pids[0], 2: pids[2]}  # the same processes
        info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    log = job_log(run_dir, job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{log}"
    events = history(run_dir)
    (rejoin,) = [e for e in events if e["event"] == "rejoin"]
    assert rejoin["dead"] == [1] and rejoin["spares"] == {"1": 0}, rejoin
    assert 3 < rejoin["died_at"] - lost < 6 + 4, rejoin  # counted dead once silent for peer_timeout_s (6 s)
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["launch"] == rejoin["launch"], resumes
    assert resumes[0]["restored_from"]["from"] == "memory", resumes[0]
    first = next(r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] == resumes[0]["step"] + 1)
    # the bound is peer_timeout_s + 3 s (bench/recovery.py measures it); room here for a slower machine
    assert first["time"] - lost < 6 + 10, (first, lost)
    assert not [e for e in events if e["event"] in ("restart", "hang")], events
    bad = [e for e in events if e["event"] == "bad_node"]  # left out of later launches
    assert rejoin["lost_nodes"] == ["n2"] and [e["node"] for e in bad] == ["n2"], (rejoin, bad)
    assert "replaced by warm spares" in bad[0]["evidence"], bad
    assert "keeper: rank 1 on n2 unheard" in (run_dir / "logs" / "keeper.log").read_text()
    assert summary(run_dir)["final_step"] == 80 and summary(run_dir)["world_size"] == 3
