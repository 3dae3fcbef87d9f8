"""A loss spike with real launches (train.spike_*): a bad batch makes the loss (and the gradient norm) spike; the launch
ends before the spike's step is saved, the run goes back to the newest checkpoint, skips the data through the bad
batch and trains to its end."""

import json

import pytest

from rundir.paths import read_jsonl
from tests.mp.test_checkpoint import TWO_NODES, common, run

pytestmark = pytest.mark.mp


# (the key that judges, its factor, the record's field that spikes, the spike event's field holding its value)
BY_LOSS = ("train.spike_factor", 3, "loss", "loss")
BY_GRAD_NORM = ("train.spike_grad_factor", 5, "grad_norm", "value")


@pytest.mark.parametrize("judged", [BY_LOSS, BY_GRAD_NORM], ids=["loss", "grad_norm"])
def test_a_spike_rolls_back_to_the_newest_checkpoint_and_skips_the_bad_batch(tmp_path, small_dataset, judged):
    """Judged by the loss, or by the gradient norm alone (spike_factor 0): rollback (the default action) goes back
    to the newest checkpoint and skips the data through the bad batch."""
    key, factor, field, value_of = judged
    run_dir = tmp_path / "run"
    sets = [
        *common(small_dataset), *TWO_NODES, "train.steps=16", f"{key}={factor}", "train.spike_window=8",
        "job.max_failures=1", "job.restart_backoff_s=0.2", "train.log_every=1",
    ]  # fmt: skip
    if field == "grad_norm":
        sets += ["train.spike_factor=0", "train.spike_action=rollback"]
    done = run(run_dir, sets, inject="spike:0:11")  # the 11th batch of the data order is bad
    assert done.returncode == 0, done.stdout + done.stderr
    events = read_jsonl(run_dir / "history.jsonl")
    spike = next(e for e in events if e["event"] == "spike")
    gbs = 32  # the tiny example's global batch
    assert spike["step"] == 11 and spike[value_of] > factor * spike["median"], spike
    assert spike["skip_to_position"] == 11 * gbs and spike.get("measure", "loss") == field, spike
    resume = next(e for e in events if e["event"] == "resume")
    assert resume["step"] == 8  # the newest checkpoint: step 11 was never saved
    assert events[-1]["event"] == "done" and [e["event"] for e in events].count("spike") == 1  # not again
    skips = json.loads((run_dir / "data_skips.json").read_text())["skips"]
    assert skips == [{"spike_step": 11, "skip_to_position": 11 * gbs}]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 17))  # every step once: 9-16 on the batches after it
    assert max(r[field] for r in records if r["step"] > 8) < factor * spike["median"]  # no spike in what was kept
    # the spike's step ended the launch before its record: its value is in the spike event only
    assert not any(r[field] == spike[value_of] for r in records)


def test_a_gradient_norm_spike_stops_the_run_with_its_checkpoint_intact(tmp_path, small_dataset):
    """The loss alone is not judged (spike_factor 0): the bad batch's gradient norm is, and stop names the step."""
    run_dir = tmp_path / "run"
    sets = [
        *common(small_dataset), *TWO_NODES, "train.steps=16", "train.spike_grad_factor=5", "train.spike_window=8",
        "train.spike_action=stop", "train.log_every=1",
    ]  # fmt: skip
    done = run(run_dir, sets, inject="spike:0:11")
    assert done.returncode == 2, done.stdout + done.stderr  # a user error: not restarted, nothing lost
    message = json.loads((run_dir / "failure.json").read_text())["message"]
    assert "gradient norm spike at step 11" in message and "train.spike_grad_factor=5" in message, message
    assert "step_00000008, is intact" in message, message
    assert max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")) == 10
