"""Job arrays for sweeps and job chains for runs longer than one job's time limit, on the real cluster."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from runconfig import load_config
from rundir.contract import EVENT_RESUME, EVENT_START, EVENT_STOPPED, EXIT_USER_ERROR, INJECT_VAR
from tests.conftest import history, run_cli
from tests.slurm.conftest import TWO_NODES, job_info, sets_for, submit, wait_state

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


def test_a_random_sweep_prunes_poor_elements_and_ranks_the_rest(slurm, small_dataset, tmp_path):
    """Four elements drawn from a log range of learning rates, one at a time (--parallel 1, so the verdicts do not
    depend on which job Slurm starts first), judged at step 4 with eta 2: an element worse than the best half of
    those that reached step 4 before it ends as pruned, its job COMPLETED, its step-4 checkpoint kept. The sweep's
    results rank every element; MLflow holds the sweep as a parent run with the four as children."""
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({
        "random": {"n": 4, "seed": 7, "train.lr": {"log": [1.0e-4, 3.0e-1]}},
        "metric": "eval_loss", "prune": {"at_steps": [4], "eta": 2},
    }))  # fmt: skip
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "hpc", "sweep", "tiny", str(spec), "--run-dir", str(sweep_dir), "--parallel", "1"]
    sets = [*sets_for(small_dataset), "job.nodes=1", "job.ranks_per_node=1", "train.steps=8", "train.eval_every=8",
            "checkpoint.every_steps=0", "train.min_lr=0", "tracking.backend=mlflow"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((sweep_dir / "sweep.json").read_text())
    lrs = [r["overrides"]["train.lr"] for r in rows]
    assert len(set(lrs)) == 4 and all(1.0e-4 <= lr <= 3.0e-1 for lr in lrs)
    for row in rows:
        assert wait_state(row["job_id"], DONE, timeout=240)["JobState"] == "COMPLETED"
    states = {}
    for row in rows:
        run_dir = Path(row["run_dir"])
        pruned = [e for e in history(run_dir) if e["event"] == "pruned"]
        states[run_dir.name] = "pruned" if pruned else "completed"
        final = json.loads((run_dir / "summary.json").read_text())["final_step"]
        assert final == (4 if pruned else 8), (run_dir, final)
        if pruned:
            assert pruned[0]["step"] == 4 and pruned[0]["reports"] >= 2
            assert (run_dir / "checkpoints" / "step_00000004").is_dir()
    assert "pruned" in states.values() and states[Path(rows[0]["run_dir"]).name] == "completed", states
    rungs = [json.loads(x) for x in (sweep_dir / "rungs.jsonl").read_text().splitlines()]
    assert sorted(r["run"] for r in rungs) == sorted(states) and {r["step"] for r in rungs} == {4}
    results = json.loads((sweep_dir / "results.json").read_text())
    assert {r["name"]: r["state"] for r in results} == states
    ranked = [r["eval_loss"] for r in results if r["eval_loss"] is not None]
    assert ranked == sorted(ranked) and len(ranked) == 4  # every element evaluated (at its rung, or at its end)
    assert "best first by eval_loss" in (sweep_dir / "results.md").read_text()
    from mlflow.tracking import MlflowClient

    parent = json.loads((sweep_dir / "tracking.json").read_text())
    client = MlflowClient(parent["uri"])
    children = client.search_runs([parent["experiment_id"]], f"tags.mlflow.parentRunId = '{parent['run_id']}'")
    assert len(children) == 4 and client.get_run(parent["run_id"]).info.status == "FINISHED"
    assert {c.data.tags["hpc.state"] for c in children} == {"done" if s == "completed" else s for s in states.values()}
    assert "results.md" in {a.path for a in client.list_artifacts(parent["run_id"])}


def test_sweep_refuses_job_keys(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"grid": {"job.nodes": [1, 2]}}))
    proc = run_cli(["-m", "hpc", "sweep", "tiny", str(grid), "--run-dir", str(tmp_path / "s")])
    assert proc.returncode == EXIT_USER_ERROR and "job shape is shared" in proc.stderr


def test_chain_of_short_jobs_finishes_a_long_run(slurm, small_dataset, tmp_path):
    """Each job has a 2-minute limit and is signalled 40 s before it; the run needs more than one job. Every job
    continues from the newest checkpoint; once training is complete the rest end at once (or the last link, which
    requeues itself when signalled, finishes it).

    slurmctld sends a job's --signal from its time-limit pass, which runs every 30 s: with a 2-minute limit and a
    40 s lead the signal is due 80 s after the job starts, and came 64 s after it here (Slurm documents it as up to
    60 s early) and no later than 110 s. So one job must need more than 110 s: 300 steps in which rank 0 sleeps
    0.4 s (0.2 s in each of its 2 micro-batches; 120 s of sleep alone), on 2 nodes x 1 rank (the ranks of a node
    under Slurm: the other tests). The sleep, not computation, sets the run's length, so that another launch on the
    same 2 cores (tests/run.sh's other workers) lengthens it little. The start-up is 6-8 s alone and took tens of
    seconds on a loaded CI machine: with a 1-minute limit (a signal 20-50 s in) the last link requeued itself 18
    times in 10 minutes, each time signalled before or soon after its first step."""
    run_dir = tmp_path / "run"
    sets = [*sets_for(small_dataset), *TWO_NODES, "train.steps=300", "checkpoint.every_steps=50", "train.eval_every=0",
            "job.time=2", "job.signal_lead_s=40", f"job.env.{INJECT_VAR}=slow:0:0.2"]  # fmt: skip
    last = submit(run_dir, sets, "--chain", "4")
    ids = [json.loads(x)["job_id"] for x in (run_dir / "jobs.jsonl").read_text().splitlines()]
    assert len(ids) == 4 and ids[-1] == last
    assert job_info(ids[1])["Dependency"].startswith(f"afterany:{ids[0]}")
    for job in ids:  # the last link may requeue itself a few times on a slow machine
        wait_state(job, DONE, timeout=600)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 300
    events = history(run_dir)
    worked = {e["slurm_job_id"] for e in events if e["event"] in (EVENT_START, EVENT_RESUME)}
    assert len(worked) >= 2, events  # one job could not finish it
    assert any(e["event"] == EVENT_STOPPED for e in events)
    last_log = subprocess.run(["bash", "-c", f"cat {run_dir}/slurm/{ids[-1]}/*_log.out"], capture_output=True,
                              text=True).stdout  # fmt: skip
    if ids[-1] not in worked:  # the chain's last job found the run complete and ended without work
        assert "already complete" in last_log
