"""A sweep element's rung (prune.*) with real launches: a launch killed between the rung's checkpoint commit and its
verdict is judged at that rung by the launch that resumes from the checkpoint, from the step's record."""

import json

import pytest

from rundir.checkpoints import read_latest
from rundir.paths import read_jsonl
from tests.mp.test_checkpoint import TWO_NODES, common, run

pytestmark = pytest.mark.mp


def test_a_kill_between_a_rungs_commit_and_its_verdict_is_judged_when_the_run_resumes(tmp_path, small_dataset):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    rungs = sweep / "rungs.jsonl"
    # two elements reported far better losses at step 4: with eta 2 only the best one continues there
    rungs.write_text("".join(json.dumps({"run": n, "step": 4, "value": v, "time": 0}) + "\n"
                             for n, v in (("p1", 0.1), ("p2", 0.2))))  # fmt: skip
    run_dir = sweep / "e1"
    sets = [
        *common(small_dataset), *TWO_NODES, "train.steps=12", "prune.metric=loss", "prune.at_steps=[4]",
        "prune.eta=2", f"prune.rungs={rungs}", "job.max_failures=1", "job.restart_backoff_s=0.2",
    ]  # fmt: skip
    done = run(run_dir, sets, inject="exit_at_rung:0:4")
    assert done.returncode == 0, done.stdout + done.stderr
    events = read_jsonl(run_dir / "history.jsonl")
    kinds = [e["event"] for e in events]
    assert "restart" in kinds and kinds[-1] == "pruned", kinds
    resume = next(e for e in events if e["event"] == "resume")
    assert resume["step"] == 4 and events[-1]["step"] == 4  # resumed from the rung's checkpoint, judged there
    reports = [r for r in read_jsonl(rungs) if r["run"] == "e1"]
    assert len(reports) == 1 and reports[0]["step"] == 4  # reported once, by the resumed launch
    record = next(r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] == 4)
    assert reports[0]["value"] == pytest.approx(record["loss"], rel=1e-12)
    assert read_latest(run_dir / "checkpoints") == "step_00000004"  # the pruned element keeps its rung's checkpoint
