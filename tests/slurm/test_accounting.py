"""`python -m hpc status` once the controller has forgotten a run's jobs: with accounting (slurmdbd + MariaDB) the
final states come from sacct, and it says so; without accounting the jobs are UNKNOWN with the reason, no crash.

This module starts its own cluster, with accounting and MinJobAge=2 (the session cluster has neither, so the other
tests run unchanged), on the session cluster's ports + 10; slurmdbd and mariadbd take ctld port + 2 and + 3."""

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from rundir.contract import EXIT_USER_ERROR
from tests.conftest import ROOT, run_cli
from tests.slurm.conftest import PORTS, job_info, sets_for, submit, wait_state

pytestmark = pytest.mark.slurm
SETTINGS = {
    "HPC_SLURM_CTLD_PORT": str(int(PORTS["HPC_SLURM_CTLD_PORT"]) + 10),
    "HPC_SLURM_NODE_PORT": str(int(PORTS["HPC_SLURM_NODE_PORT"]) + 10),
    "HPC_SLURM_FIRST_JOB_ID": str(int(PORTS["HPC_SLURM_FIRST_JOB_ID"]) + 30_000),
    "HPC_SLURM_MIN_JOB_AGE": "2",  # a finished job leaves the controller about 10 s after it ended
}


def cluster(verb: str, state: Path, *, accounting: bool, check: bool = True) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HPC_SLURM_ACCOUNTING"} | SETTINGS
    if accounting:
        env["HPC_SLURM_ACCOUNTING"] = "1"
    out = subprocess.DEVNULL if verb == "install" else None
    subprocess.run(["bash", "envs/slurm/cluster.sh", verb, str(state)], check=check, cwd=ROOT, env=env, stdout=out)


@pytest.fixture(scope="module")
def accounting_cluster():
    state = Path(tempfile.mkdtemp(prefix="hpc-slurm-acct-test-", dir="/tmp"))
    state.chmod(0o755)  # the munge and mysql users must traverse it
    cluster("install", state, accounting=True)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")
    try:
        cluster("start", state, accounting=True)
        yield state
    finally:
        cluster("wipe", state, accounting=True, check=False)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def hpc(*args) -> subprocess.CompletedProcess:
    return run_cli(["-m", "hpc", *args])


def status(run_dir) -> dict:
    proc = hpc("status", str(run_dir), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def forgotten(job_id: str) -> bool:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    return out.returncode != 0 and "Invalid job id" in out.stderr


def test_status_after_the_controller_forgot_the_jobs(accounting_cluster, small_dataset, tmp_path):
    # a run that completes, and one cancelled while it runs
    small = [*sets_for(small_dataset), "job.nodes=1", "job.ranks_per_node=1", "train.eval_every=4"]
    small.append("cost.node_hour=3600")  # the cost is the node-seconds
    done_dir, cancelled_dir = tmp_path / "done", tmp_path / "cancelled"
    done_id = submit(done_dir, [*small, "train.steps=8"])
    cancelled_id = submit(cancelled_dir, [*small, "train.steps=100000"])
    wait_state(cancelled_id, {"RUNNING"})
    proc = hpc("cancel", str(cancelled_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Both end, and the controller forgets them at its next purge pass after MinJobAge (measured: 8-12 s after the
    # end). scontrol may never show their final states, so wait for them to be gone; sacct then says how they ended.
    deadline = time.monotonic() + 300
    while not (forgotten(done_id) and forgotten(cancelled_id)):
        assert time.monotonic() < deadline, f"the controller still knows the jobs: {job_info(done_id)}"
        time.sleep(1)

    # with accounting: the final states from sacct, marked as such
    info = status(done_dir)
    assert info["state"] == "completed" and info["step"] == 8
    assert info["jobs"] == [{"job_id": done_id, "state": "COMPLETED", "reason": "", "restarts": 0, "source": "sacct"}]
    text = hpc("status", str(done_dir)).stdout
    assert f"job {done_id}: COMPLETED, 0 requeues (from sacct: the controller no longer knows the job)" in text
    job = status(cancelled_dir)["jobs"][0]
    assert (job["state"], job["reason"], job["source"]) == ("CANCELLED", "by 0", "sacct")  # sacct: "CANCELLED by 0"
    proc = hpc("cancel", str(cancelled_dir))  # the verbs see it finished
    assert proc.returncode == EXIT_USER_ERROR and "no unfinished Slurm job" in proc.stderr
    check_cost_from_sacct(done_dir, done_id)

    # without accounting (the same controller state, slurmdbd gone): UNKNOWN, with the reason
    cluster("stop", accounting_cluster, accounting=False)
    cluster("start", accounting_cluster, accounting=False)
    sacct = subprocess.run(["sacct", "-j", done_id], capture_output=True, text=True)
    assert sacct.returncode != 0 and "accounting storage is disabled" in sacct.stderr
    info = status(done_dir)
    job = info["jobs"][0]
    assert info["state"] == "completed" and (job["job_id"], job["state"], job["source"]) == (done_id, "UNKNOWN", "")
    assert "controller no longer knows it" in job["reason"] and "accounting storage is disabled" in job["reason"]
    text = hpc("status", str(done_dir)).stdout
    assert f"job {done_id}: UNKNOWN (the controller no longer knows it" in text
    assert status(cancelled_dir)["jobs"][0]["state"] == "UNKNOWN"
    row = runs_row(done_dir)  # the cost from the launches, and why
    assert row["cost_source"] == "launches", row
    assert row["node_hours"] * 3600 == pytest.approx(launches_wall(done_dir), rel=1e-6)
    report = hpc("report", str(done_dir))
    assert (
        "(launches)" in report.stdout
        and "accounting storage is disabled" in (done_dir / "report/report.md").read_text()
    )
    proc = hpc("cancel", str(cancelled_dir))
    assert proc.returncode == EXIT_USER_ERROR and "no unfinished Slurm job" in proc.stderr


def runs_row(run_dir) -> dict:
    proc = hpc("runs", str(run_dir), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)[0]


def launches_wall(run_dir) -> float:
    """The launches' wall time as history.jsonl has it: the start event's process start to the end event."""
    events = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    starts = [e["process_start"] for e in events if e["event"] in ("start", "resume")]
    ends = [e["time"] for e in events if e["event"] in ("done", "stopped")]
    assert len(starts) == len(ends) == 1, events
    return ends[0] - starts[0]


def check_cost_from_sacct(run_dir, job_id: str) -> None:
    """The cost from accounting: sacct's elapsed x nodes, which hold the launch's wall time and the job's own
    set-up around it; the queue wait from its submission to its start."""
    acct = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "ElapsedRaw,AllocNodes,Submit,Eligible,Start"],
        capture_output=True, text=True, env={**os.environ, "SLURM_TIME_FORMAT": "%s"}, check=True,
    )  # fmt: skip
    elapsed, nodes, submit, eligible, start = (int(x) for x in acct.stdout.split("|"))
    row = runs_row(run_dir)
    assert row["cost_source"] == "sacct" and nodes == 1, (row, acct.stdout)
    assert row["node_hours"] * 3600 == pytest.approx(elapsed * nodes) and row["gpu_hours"] == 0
    queued = start - max(submit, eligible)  # from when it could start
    assert row["cost"] == pytest.approx(elapsed * nodes) and row["queued_s"] == pytest.approx(queued)
    wall = launches_wall(run_dir)
    print(f"sacct elapsed {elapsed} s, launch wall {wall:.2f} s, queued {queued} s")
    # the allocation holds the launch (sacct counts whole seconds) and the job's own set-up (seconds here; a slow,
    # loaded machine takes longer to start the driver and srun)
    assert wall - 1 <= elapsed <= wall + 60, (elapsed, wall)
    report = hpc("report", str(run_dir))
    assert report.returncode == 0, report.stdout + report.stderr
    assert f"node-hours, 0 GPU-hours (sacct), {elapsed * nodes:,.2f} USD" in report.stdout, report.stdout
    md = (run_dir / "report" / "report.md").read_text()
    assert "From Slurm accounting (sacct): 1 run(s) of the run's jobs; price: 3600 USD a node-hour." in md
