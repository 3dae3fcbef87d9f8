"""`python -m hpc status/pause/release/logs/cancel/resume` on a real Slurm job, without accounting (slurmdbd)."""

import json
import subprocess
import time

import pytest

from rundir.contract import EVENT_RESUME, EVENT_STOPPED, EXIT_USER_ERROR
from tests.conftest import history, run_cli
from tests.slurm.conftest import TWO_NODES, job_info, sets_for, submit, wait_state, wait_step

pytestmark = pytest.mark.slurm


def hpc(*args):
    return run_cli(["-m", "hpc", *args])


def status(run_dir) -> dict:
    proc = hpc("status", str(run_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def wait_for(predicate, what, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_status_pause_release_logs_cancel_resume(slurm, small_dataset, tmp_path):
    run_dir = tmp_path / "run"
    sets = [*sets_for(small_dataset), *TWO_NODES, "train.steps=200", "checkpoint.every_steps=50"]
    job_id = submit(run_dir, sets)
    wait_step(run_dir, 10)
    # A second launch of the running run (the command a stopped run's message prints) is refused, naming the job.
    second = run_cli(["-m", "hpc.submit", "--resume", str(run_dir)])
    assert second.returncode == EXIT_USER_ERROR and f"Slurm job {job_id} (RUNNING)" in second.stderr, second.stderr

    info = status(run_dir)
    assert info["state"] == "running" and info["jobs"][0]["job_id"] == job_id and info["steps"] == 200
    assert info["step"] >= 10
    text = hpc("status", str(run_dir)).stdout
    assert f"job {job_id}: RUNNING" in text and "step " in text

    # pause: the ranks stop at a step boundary with a checkpoint, the driver requeues the job held
    assert hpc("pause", str(run_dir)).returncode == 0
    wait_for(lambda: "held" in job_info(job_id).get("Reason", "").lower(), "the job to be held")
    info = status(run_dir)
    stopped = [e for e in history(run_dir) if e["event"] == EVENT_STOPPED]
    assert info["state"] == "paused" and stopped
    assert info["checkpoint"]["step"] == stopped[-1]["step"] >= 10

    logs = hpc("logs", str(run_dir), "--rank", "0")
    assert logs.returncode == 0 and "stop requested" in logs.stdout and "rank 0/2" in logs.stdout
    assert hpc("logs", str(run_dir), "--all").stdout.count("rank 1/2") >= 1

    # release: it runs again from the checkpoint
    assert hpc("release", str(run_dir)).returncode == 0
    resumed = wait_for(lambda: [e for e in history(run_dir) if e["event"] == EVENT_RESUME], "the resume")
    assert resumed[0]["step"] == stopped[-1]["step"]
    wait_step(run_dir, resumed[0]["step"] + 5)

    # cancel, then resume as a new job that finishes the run
    restarts = job_info(job_id)["Restarts"]
    cancelled_at = time.time()
    assert hpc("cancel", str(run_dir)).returncode == 0
    assert wait_state(job_id, {"CANCELLED", "COMPLETED", "FAILED"})["JobState"] == "CANCELLED"
    assert hpc("cancel", str(run_dir)).returncode == EXIT_USER_ERROR  # nothing left to cancel: a clear error
    proc = hpc("resume", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    new_id = json.loads((run_dir / "jobs.jsonl").read_text().splitlines()[-1])["job_id"]
    assert new_id != job_id
    # The ranks stopped on scancel's SIGTERM with a checkpoint, and the driver must not requeue a cancelled job (it
    # did once: the job came back 6 s later, cred_expire + 1): the old job is watched while the new one runs, for
    # 12 s at least.
    watch_until = time.monotonic() + 12
    deadline = time.monotonic() + 240
    while (state := job_info(new_id)["JobState"]) not in {"COMPLETED", "FAILED", "CANCELLED"} or (
        time.monotonic() < watch_until
    ):
        info = job_info(job_id)
        assert info["JobState"] == "CANCELLED" and info["Restarts"] == restarts, info
        assert time.monotonic() < deadline, f"job {new_id} did not end within 240 s: {job_info(new_id)}"
        time.sleep(0.5)
    assert state == "COMPLETED", job_info(new_id)
    stops = [e for e in history(run_dir) if e["event"] == EVENT_STOPPED and e["time"] >= cancelled_at]
    assert all(e["signal"] == 15 for e in stops), stops  # stopped by scancel's SIGTERM (when in time)
    info = status(run_dir)
    assert info["state"] == "completed" and info["step"] == 200 and info["restarts"] >= 2


def test_release_takes_a_job_still_completing_its_requeue_hold(slurm, tmp_path):
    """A paused run's job requeue-holds itself (hpc/driver.py); Slurm shows Reason=job_requeued_in_held_state while
    the job is still COMPLETING, before PENDING. `release` in that window must release it: once it answered "no held
    job" there, and the run stayed held for good (a loaded CI host made the window seconds long). Here the batch
    script ignores SIGTERM, so the job stays COMPLETING until KillWait's SIGKILL."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first_run = '[ "${SLURM_RESTART_COUNT:-0}" = 0 ]'
    script = f'if {first_run}; then trap "" TERM; scontrol requeuehold $SLURM_JOB_ID; fi; sleep 120'
    out = subprocess.run(
        ["sbatch", "--parsable", "--requeue", "-N1", "-o", str(tmp_path / "job-%j.out"), "--wrap", script],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    job_id = out.stdout.strip().split(";")[0]
    (run_dir / "jobs.jsonl").write_text(json.dumps({"job_id": job_id}) + "\n")
    (run_dir / "config.yaml").write_text("# a hand-made job's run directory: release reads only jobs.jsonl\n")

    def completing_held() -> bool:
        info = job_info(job_id)
        return info.get("JobState") == "COMPLETING" and "held" in info.get("Reason", "")

    wait_for(completing_held, "the job completing its requeue hold")
    released = hpc("release", str(run_dir))
    assert released.returncode == 0 and f"released job {job_id}" in released.stdout, released.stdout
    info = wait_state(job_id, {"RUNNING"}, timeout=90)
    assert int(info["Restarts"]) == 1
    subprocess.run(["scancel", job_id], check=True)
