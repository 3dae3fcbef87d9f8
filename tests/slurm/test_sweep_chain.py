"""Job arrays for sweeps and job chains for runs longer than one job's time limit, on the real cluster."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from runconfig import load_config
from runconfig.contract import EVENT_RESUME, EVENT_START, EVENT_STOPPED, EXIT_USER_ERROR, INJECT_VAR
from tests.conftest import history, run_cli
from tests.slurm.conftest import job_info, sets_for, submit, wait_state

pytestmark = pytest.mark.slurm
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


def test_sweep_is_one_job_array_with_a_run_directory_per_element(slurm, small_dataset, tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        yaml.safe_dump({"grid": {"train.lr": [1.0e-3, 3.0e-3], "model.d_model": [32, 64]}}, sort_keys=False)
    )
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "hpc", "sweep", "tiny", str(grid), "--run-dir", str(sweep_dir)]
    for s in [*sets_for(small_dataset), "job.nodes=1", "job.ranks_per_node=1", "train.steps=8", "train.eval_every=4"]:
        args += ["--set", s]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((sweep_dir / "sweep.json").read_text())
    assert len(rows) == 4
    array_ids = {r["job_id"].split("_")[0] for r in rows}
    assert len(array_ids) == 1  # one job array
    assert sorted(r["job_id"].split("_")[1] for r in rows) == ["0", "1", "2", "3"]
    expected = [(1.0e-3, 32), (1.0e-3, 64), (3.0e-3, 32), (3.0e-3, 64)]
    for row, (lr, width) in zip(rows, expected, strict=True):
        cfg = load_config(str(row["run_dir"]) + "/config.yaml")
        assert (cfg.train.lr, cfg.model.d_model, cfg.train.steps) == (lr, width, 8)
        assert row["overrides"] == {"train.lr": lr, "model.d_model": width}
    for row in rows:
        assert wait_state(row["job_id"], DONE, timeout=240)["JobState"] == "COMPLETED"
        summary = json.loads(Path(row["run_dir"], "summary.json").read_text())
        assert summary["final_step"] == 8 and summary["world_size"] == 1


def test_sweep_refuses_job_keys(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"grid": {"job.nodes": [1, 2]}}))
    proc = run_cli(["-m", "hpc", "sweep", "tiny", str(grid), "--run-dir", str(tmp_path / "s")])
    assert proc.returncode == EXIT_USER_ERROR and "job shape is shared" in proc.stderr


def test_chain_of_short_jobs_finishes_a_long_run(slurm, small_dataset, tmp_path):
    """Each job has a 1-minute limit and is signalled 40 s before it; the run needs more than one job. Every job
    continues from the newest checkpoint; once training is complete the rest end at once (or the last link, which
    requeues itself when signalled, finishes it).

    slurmctld sends a job's --signal from its time-limit pass, which runs every 30 s: with a 1-minute limit and a
    40 s lead the signal is due 20 s after the job starts and comes 20-50 s after it. So one job must need more than
    50 s: 200 steps in which rank 0 sleeps 0.2 s (about 48 s of training after 10-16 s of start-up; 150 steps, 36 s,
    once finished inside one job whose time-limit pass came late). The sleep, not computation, sets the run's
    length, so that another launch on the same 2 cores (tests/run.sh's second worker) lengthens it little; a link
    that trains only a few seconds under such load leaves the rest to the next, and the last link requeues itself
    until the run is complete."""
    run_dir = tmp_path / "run"
    sets = [*sets_for(small_dataset), "train.steps=200", "checkpoint.every_steps=50", "train.eval_every=0",
            "job.time=1", "job.signal_lead_s=40", f"job.env.{INJECT_VAR}=slow:0:0.2"]  # fmt: skip
    last = submit(run_dir, sets, "--chain", "4")
    ids = [json.loads(x)["job_id"] for x in (run_dir / "jobs.jsonl").read_text().splitlines()]
    assert len(ids) == 4 and ids[-1] == last
    assert job_info(ids[1])["Dependency"].startswith(f"afterany:{ids[0]}")
    for job in ids:  # the last link may requeue itself a few times on a slow machine
        wait_state(job, DONE, timeout=600)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 200
    events = history(run_dir)
    worked = {e["slurm_job_id"] for e in events if e["event"] in (EVENT_START, EVENT_RESUME)}
    assert len(worked) >= 2, events  # one job could not finish it
    assert any(e["event"] == EVENT_STOPPED for e in events)
    last_log = subprocess.run(["bash", "-c", f"cat {run_dir}/slurm/{ids[-1]}/*_log.out"], capture_output=True,
                              text=True).stdout  # fmt: skip
    if ids[-1] not in worked:  # the chain's last job found the run complete and ended without work
        assert "already complete" in last_log
