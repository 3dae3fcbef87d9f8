"""Bad nodes left out on a REAL Slurm cluster (3 nodes, tests/slurm/conftest.py): the node a failure points at is
named in history with the evidence and never used again by the run, either in the same allocation (the world
shrinks to job.min_nodes) or in a new job submitted with --exclude."""

import json
import os
import signal

import pytest

from runconfig.contract import EVENT_RESTART, EVENT_RESUME
from tests.conftest import history, rank_pids, summary
from tests.slurm.conftest import job_info, job_log, sets_for, submit, wait_state, wait_step

pytestmark = pytest.mark.slurm


def events_of(run_dir, name):
    return [e for e in history(run_dir) if e["event"] == name]


def test_a_killed_ranks_node_is_excluded_in_a_new_job_and_the_run_ends_bitwise(
    slurm, small_dataset, reference, tmp_path
):
    """2 nodes needed (job.min_nodes unset): rank 1 on n1 is killed, n1 is named, and the run continues in a new job
    excluding n1 (a running job's exclusions cannot change; a requeue could land on n1 again): on n2 and n3, same
    world size, bit-identical to the uninterrupted run."""
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, [*sets_for(small_dataset), "job.restart_backoff_s=0.5"])
    wait_step(run_dir, 12)
    pids = rank_pids(run_dir)
    os.kill(pids[1], signal.SIGKILL)
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    assert info["JobState"] == "COMPLETED", f"{info}\n{job_log(run_dir, job_id)}"
    jobs = [json.loads(line) for line in (run_dir / "jobs.jsonl").read_text().splitlines()]
    assert len(jobs) == 2 and jobs[1]["exclude"] == ["n1"] and jobs[1]["reason"] == "exclude", jobs
    new_id = jobs[1]["job_id"]
    info = wait_state(new_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    assert info["JobState"] == "COMPLETED", f"{info}\n{job_log(run_dir, new_id)}"
    assert info["ExcNodeList"] == "n1" and info["NodeList"] == "n[2-3]", info
    bad = events_of(run_dir, "bad_node")
    assert [e["node"] for e in bad] == ["n1"] and "rank 1" in bad[0]["evidence"], bad
    restart = events_of(run_dir, EVENT_RESTART)
    assert len(restart) == 1 and restart[0]["how"] == "new job" and restart[0]["excluded"] == ["n1"], restart
    resumed = events_of(run_dir, EVENT_RESUME)[-1]
    assert resumed["slurm_job_id"] == new_id and resumed["nodes"] == ["n2", "n3"], resumed
    assert f"the run continues in job {new_id} (--exclude=n1)" in job_log(run_dir, job_id)
    assert summary(run_dir)["params_sha256"] == reference


def test_a_nodes_ranks_all_killed_shrink_the_run_in_the_job(slurm, small_dataset, tmp_path):
    """job.min_nodes=1: both ranks of n2 are killed; the driver names n2 and restarts the ranks in the same
    allocation on n1 alone (2 ranks, twice the gradient accumulation, same global batch); n2 is not used again."""
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, [*sets_for(small_dataset), "job.restart_backoff_s=0.5", "job.min_nodes=1"])
    wait_step(run_dir, 12)
    pids = rank_pids(run_dir)
    for rank in (2, 3):
        os.kill(pids[rank], signal.SIGKILL)
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    log = job_log(run_dir, job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{log}"
    assert [e["node"] for e in events_of(run_dir, "bad_node")] == ["n2"], history(run_dir)
    restart = events_of(run_dir, EVENT_RESTART)
    assert len(restart) == 1 and restart[0]["how"] == "in-job" and restart[0]["nodes"] == ["n1"], restart
    resumed = events_of(run_dir, EVENT_RESUME)[-1]
    assert resumed["nodes"] == ["n1"] and resumed["world_size"] == 2, resumed
    assert "--nodes=1 --ntasks=2 --nodelist=n1" in log, log
    assert summary(run_dir)["world_size"] == 2 and summary(run_dir)["final_step"] == 60
    assert job_info(job_id)["NodeList"] == "n[1-2]"
