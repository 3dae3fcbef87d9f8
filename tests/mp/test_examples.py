"""The user projects under examples/ as a user runs them (from the repository root, through `python -m hpc.submit`):
they train on 2 simulated nodes x 2 ranks with the loss falling, and a run stopped by a signal and later killed
with SIGKILL, each time resumed, ends bit-identical to the uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from rundir.checkpoints import latest_committed
from rundir.contract import (
    EVENT_CODE,
    EVENT_RESTART,
    EVENT_RESUME,
    EVENT_START,
    EVENT_STOPPED,
    EXIT_STOPPED,
    INJECT_VAR,
)
from tests.conftest import PY, ROOT, example_args, history, rank_pids, summary, wait_for_step

pytestmark = pytest.mark.mp
KEYS = ("step", "loss", "lr", "grad_norm", "eval_loss", "eval_accuracy", "tokens_seen")


def rows(run_dir) -> list[dict]:
    return [{k: r.get(k) for k in KEYS} for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def start(args: list[str], *, slow: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if slow:  # rank 0 sleeps 50 ms a step, so a signal lands mid-run however fast the steps are (timing only)
        env[INJECT_VAR] = "slow:0:0.05"
    return subprocess.Popen([PY, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def wait_for_checkpoint_after(run_dir, step: int, proc, timeout: float = 120) -> int:
    """The step of the first checkpoint newer than ``step``, as soon as it is committed (its manifest written)."""
    deadline = time.monotonic() + timeout
    while (manifest := latest_committed(run_dir / "checkpoints")) is None or manifest["step"] <= step:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no checkpoint after step {step} within {timeout} s"
        time.sleep(0.01)
    return manifest["step"]


@pytest.mark.parametrize("name,first_loss,last_loss", [("digits", 2.0, 1.0), ("lm_bpe", 7.0, 6.0)])
def test_example_trains_and_resumes_bitwise(tmp_path, example_reference, name, first_loss, last_loss):
    reference = example_reference(name)
    ref_rows = rows(reference)
    assert ref_rows[0]["loss"] > first_loss and ref_rows[-1]["loss"] < last_loss, (ref_rows[0], ref_rows[-1])
    assert summary(reference)["recipe"] == f"{name}.train:recipe" and len(summary(reference)["code_sha256"]) == 64
    assert summary(reference)["allreduce"] == "hierarchical"  # 2 nodes x 2 ranks: the hook ran
    if name == "lm_bpe":  # the multi-rank run that prepares its data on first use (rank 0 does, the others wait)
        assert "(first use, tokenizer examples/lm_bpe/" in (reference / "logs" / "rank_00000.log").read_text()

    run_dir = tmp_path / "run"
    proc = start(example_args(name, run_dir, "--local"), slow=True)
    wait_for_step(run_dir, 6, proc)
    os.kill(rank_pids(run_dir)[2], signal.SIGUSR2)  # one rank: all stop at the next boundary with a checkpoint
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == EXIT_STOPPED, out + err

    proc = start(["-m", "hpc.submit", str(run_dir), "--local", "--set", "job.restart_backoff_s=0.2"], slow=True)
    stopped_at = [e for e in history(run_dir) if e["event"] == EVENT_STOPPED][-1]["step"]
    committed = wait_for_checkpoint_after(run_dir, stopped_at, proc)  # the first this launch writes
    os.kill(rank_pids(run_dir)[1], signal.SIGKILL)  # the launcher restarts the ranks from that checkpoint itself
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err
    events = [e["event"] for e in history(run_dir) if e["event"] != "preflight"]
    assert events[:3] == [EVENT_CODE, EVENT_START, EVENT_STOPPED] and events.count(EVENT_RESTART) == 1, events
    assert [e["step"] for e in history(run_dir) if e["event"] == EVENT_RESUME][-1] >= committed
    assert summary(run_dir)["params_sha256"] == summary(reference)["params_sha256"]
    assert rows(run_dir) == ref_rows


@pytest.mark.parametrize(
    "name,layout",
    [("digits", ["parallel.dp_replicate=1", "parallel.dp_shard=-1"]), ("lm_bpe", ["parallel.dp_shard=2"])],
)
def test_example_trains_sharded_like_ddp(tmp_path, example_reference, name, layout):
    """A user's recipe under FSDP2 (digits: an MLP without blocks, sharded whole) and HSDP (lm_bpe: its own
    transformer, sharded block by block): the same losses as its DDP run within float tolerance (the same per-rank
    dropout streams and data; only the order of the gradient sums differs). The rounding differences grow with the
    steps: lm_bpe's stay within 4e-7 through step 8, then reach 2.4e-3 by step 15 (lr 3e-3, dropout), while a batch
    or a shard that differed would move a loss by 1e-2 or more at once."""
    reference = example_reference(name)
    run_dir = tmp_path / "run"
    proc = start(example_args(name, run_dir, "--local", *(a for s in layout for a in ("--set", s))), slow=False)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert summary(run_dir)["allreduce"] == ("fsdp" if name == "digits" else "hsdp")
    got, want = rows(run_dir), rows(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        for key in ("loss", "eval_loss", "eval_accuracy"):
            if b[key] is not None:
                assert abs(a[key] - b[key]) < (1e-4 if b["step"] <= 8 else 5e-3), (key, a, b)


def test_user_recipe_trains_tensor_parallel_like_ddp(tmp_path):
    """digits' own tp_plan (its MLP's Linear layers split in pairs over the 2 ranks of one node): the same losses
    and accuracy as DDP on those 2 ranks within float tolerance, half the state per rank (TP across replicas on 2
    nodes: tests/mp/test_parallel.py). Dropout is off in both runs: under tensor parallelism each rank draws the
    masks of its share of the units, which no data-parallel run reproduces."""
    runs = {}
    for name, extra in {"ddp": [], "tp": ["--set", "parallel.tp=2"]}.items():
        run_dir = runs[name] = tmp_path / name
        one_node = ["--set", "job.nodes=1", "--set", "recipe_args.dropout=0"]
        args = example_args("digits", run_dir, "--local", *one_node, *extra)
        out, err = start(args, slow=False).communicate(timeout=300)
        assert summary(run_dir)["final_step"] == 40, out + err
    tp, ddp = summary(runs["tp"]), summary(runs["ddp"])
    assert tp["allreduce"] == "tp" and tp["parallel"]["tp"] == 2 and tp["n_params"] == ddp["n_params"]  # no replica
    assert 0.49 < tp["state_bytes_per_rank"]["params"] / ddp["state_bytes_per_rank"]["params"] < 0.53
    got, want = rows(runs["tp"]), rows(runs["ddp"])
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        for key in ("loss", "eval_loss", "eval_accuracy"):
            if b[key] is not None:
                assert abs(a[key] - b[key]) < 1e-4, (key, a, b)


def test_a_recipe_over_a_datasets_dataset_saved_to_disk(tmp_path):
    """examples/hf_text as its README runs it, shortened: make_dataset.py saves a DatasetDict cut with Dataset.map,
    the recipe wraps load_from_disk's splits; two ranks train on it and evaluate."""
    data = tmp_path / "hf_text_data"
    made = subprocess.run([PY, "examples/hf_text/hf_text/make_dataset.py", str(data), "--max-bytes", "60000",
                           "--seq-len", "32"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1"})  # fmt: skip
    assert made.returncode == 0 and (data / "dataset_dict.json").is_file(), made.stdout + made.stderr
    run_dir = tmp_path / "run"
    short = ["recipe_args.dataset=" + str(data), "train.steps=6", "train.eval_every=6", "train.eval_sequences=32",
             "train.warmup_steps=1", "checkpoint.every_steps=0"]  # fmt: skip
    args = ["-m", "hpc.submit", "examples/hf_text/config.yaml", "--local", "--run-dir", str(run_dir)]
    proc = subprocess.run([PY, *args, *(a for s in short for a in ("--set", s))], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = summary(run_dir)
    assert done["final_step"] == 6 and done["world_size"] == 2 and done["recipe"] == "hf_text.train:recipe", done
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["eval_loss"] is not None and records[-1]["loss"] < records[0]["loss"], records
