"""``python -m hpc sweep`` without Slurm (hpc/sweep_submit.py): the elements run one after the other on this machine,
each in its own run directory under the sweep's, and the last one to end prints the results table, best first."""

import json
from pathlib import Path

import pytest
import yaml

from runconfig import load_config
from tests.conftest import history, run_cli

pytestmark = pytest.mark.mp


def test_a_sweep_without_slurm_runs_its_elements_one_after_the_other_here(tmp_path, small_dataset, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-slurm.conf"))  # no cluster here, even where one is installed
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"grid": {"train.lr": [1.0e-3, 3.0e-3]}}))
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "hpc", "sweep", "tiny", str(grid), "--run-dir", str(sweep_dir)]  # no --local: chosen for it
    sets = [f"data.path={small_dataset}", "job.nodes=1", "job.ranks_per_node=1", "train.steps=4",
            "train.warmup_steps=1", "train.eval_every=4", "train.eval_sequences=8", "model.d_model=32",
            "model.n_layers=1", "model.seq_len=64", "checkpoint.every_steps=0"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "submitted" not in proc.stdout and not list(sweep_dir.glob("**/jobs.jsonl")), "no job array"

    rows = json.loads((sweep_dir / "sweep.json").read_text())
    assert [r["overrides"] for r in rows] == [{"train.lr": 1.0e-3}, {"train.lr": 3.0e-3}]
    assert [r["job_id"] for r in rows] == ["", ""]
    runs = [Path(r["run_dir"]) for r in rows]
    assert [p.parent for p in runs] == [sweep_dir, sweep_dir] and runs[0] != runs[1]
    for run_dir, lr in zip(runs, (1.0e-3, 3.0e-3), strict=True):
        assert load_config(str(run_dir / "config.yaml")).train.lr == lr
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["final_step"] == 4 and summary["world_size"] == 1, summary
    first, second = (history(p) for p in runs)
    assert first[-1]["event"] == "done" and second[-1]["event"] == "done"
    assert first[-1]["time"] <= second[0]["time"], "the second element started before the first one ended"

    results = json.loads((sweep_dir / "results.json").read_text())
    assert sorted(r["name"] for r in results) == sorted(p.name for p in runs)
    assert all(r["state"] == "completed" for r in results), results
    ranked = [r["eval_loss"] for r in results]
    assert None not in ranked and ranked == sorted(ranked), ranked  # best first by the sweep's metric
    table = (sweep_dir / "results.md").read_text()
    assert "2 elements, best first by eval_loss" in table and table.strip() in proc.stdout  # printed once, at the end
    assert proc.stdout.count("best first by eval_loss") == 1
