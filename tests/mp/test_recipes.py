"""A user's recipe through `python -m hpc.submit`: bad input named clearly, the prefetch hiding a slow dataset, and
the code snapshot that makes a resumed launch run the submitted code. The project lives outside the package
(tests/mp/projects/toyproj, copied next to a config in tmp_path), as a user's would."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from rundir.checkpoints import read_latest
from rundir.contract import EXIT_USER_ERROR
from tests.conftest import history, run_cli, summary
from tests.mp.test_checkpoint import TWO_NODES

pytestmark = pytest.mark.mp
PROJECT = Path(__file__).parent / "projects" / "toyproj"


def make_project(tmp_path: Path, recipe: str, args: dict | None = None, **sections) -> Path:
    """A config next to a copy of the toy project; returns the config file."""
    folder = tmp_path / "proj"
    if not (folder / "toyproj").exists():
        shutil.copytree(PROJECT, folder / "toyproj", ignore=shutil.ignore_patterns("__pycache__"))
    config = {
        "recipe": f"toyproj.{recipe}",
        "recipe_args": args or {},
        "job": {"name": "toy", "nodes": 1, "ranks_per_node": 2},
        "train": {"steps": 8, "global_batch_size": 16, "micro_batch_size": 4, "warmup_steps": 2, "eval_every": 0},
        "checkpoint": {"every_steps": 2},
        "monitor": {"tensorboard": False},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def submit(target, run_dir=None, *sets, resume=False):
    args = ["-m", "hpc.submit", str(target), "--local"]
    args += ["--run-dir", str(run_dir)] if run_dir else []
    args += ["--resume"] if resume is True else [resume] if resume else []
    for s in sets:
        args += ["--set", s] if not s.startswith("--") else [s]
    return run_cli(args)


def records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


BAD = [
    (
        "broken:recipe",
        {},
        "module 'toyproj.broken' does not import: ModuleNotFoundError: No module named 'not_a_module",
    ),
    ("recipes:nope", {}, "module 'toyproj.recipes' ("),
    ("recipes:not_callable", {}, "'not_callable' is a int, not a function"),
    ("recipes:wrong_kind", {}, "returned dict, not a trainer.recipes.Recipe"),
    ("recipes:no_params", {}, "the model (ReLU) has no trainable parameters"),
    ("recipes:empty", {}, "train_data is empty (length 0)"),
    ("recipes:short", {}, "train_data holds 10 samples, fewer than one global batch (train.global_batch_size=16)"),
    ("recipes:ragged", {}, "train_data items differ in structure, shape or dtype: item 0 is"),
    ("recipes:vector_loss", {}, "the loss of the first batch is a tensor of shape [4]"),
    ("recipes:recipe", {"hidden": 0}, "rejected its recipe_args: ValueError: hidden must be a positive width, got 0"),
    ("recipes:recipe", {"widht": 3}, "does not take these recipe_args: got an unexpected keyword argument 'widht'"),
]


@pytest.mark.parametrize(
    "recipe,parallel,needle",
    [
        ("recipes:recipe", {"tp": 2}, "parallel.tp=2: recipe 'toyproj.recipes:recipe' gives no tensor-parallel plan"),
        ("recipes:wrong_tp_plan", {"tp": 2}, "the first forward under parallel.tp=2 raised RuntimeError: "),
        ("recipes:recipe", {"pp": 2}, "parallel.pp=2: recipe 'toyproj.recipes:recipe' does not say how to cut its"),
        ("recipes:recipe", {"cp": 2}, "parallel.cp=2: recipe 'toyproj.recipes:recipe' gives no Recipe.context_par"),
        # Raised inside the schedule on the last stage while stage 0 waits for its gradients: the job ends at once.
        (
            "recipes:vector_pipeline_loss",
            {"pp": 2},
            "rank 1: recipe 'toyproj.recipes:vector_pipeline_loss': the "
            "recipe's Pipeline.loss returned a tensor of shape [2] on the last pipeline stage",
        ),
    ],
)
def test_parallelism_a_recipe_does_not_support_is_refused(tmp_path, recipe, parallel, needle):
    proc = submit(make_project(tmp_path, recipe, parallel=parallel), tmp_path / "run")
    assert proc.returncode == EXIT_USER_ERROR, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: ") and needle in proc.stderr, proc.stderr


#: Bad recipes whose launch runs 2 ranks: the message must come once, from one rank, though every rank finds the
#: fault (one that fails at import, one at the first batch); the others run 1 rank, half the CPU on 2 cores.
TWO_RANKS = {"broken:recipe", "recipes:vector_loss"}


@pytest.mark.parametrize("recipe,args,needle", BAD, ids=[f"{r}-{sorted(a)}" for r, a, _ in BAD])
def test_bad_recipe_is_named_before_training(tmp_path, recipe, args, needle):
    run_dir = tmp_path / "run"
    ranks = {"ranks_per_node": 2 if recipe in TWO_RANKS else 1}
    proc = submit(make_project(tmp_path, recipe, args, job=ranks), run_dir)
    assert proc.returncode == EXIT_USER_ERROR, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: ") and needle in proc.stderr, proc.stderr
    assert f"toyproj.{recipe}" in proc.stderr, proc.stderr  # the recipe is named
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text()


def test_missing_tokenizer_is_named(tmp_path):
    proc = submit("tiny", tmp_path / "run", "data.tokenizer=/nonexistent/tokenizer.json", "train.steps=2", *TWO_NODES)
    assert proc.returncode == EXIT_USER_ERROR, proc.stdout + proc.stderr
    assert "/nonexistent/tokenizer.json" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def test_non_finite_loss_stops_with_the_last_checkpoint_intact(tmp_path):
    """Rank 1's loss turns NaN at step 5 (its 10th call; call 1 is the start-up check): every rank stops, rank 1 and
    the step are named, nothing of step 5 is saved and step 4's checkpoint stays the latest."""
    run_dir = tmp_path / "run"
    proc = submit(make_project(tmp_path, "recipes:nan_loss", {"bad_rank": 1, "from_call": 10}), run_dir)
    assert proc.returncode == EXIT_USER_ERROR, proc.stdout + proc.stderr
    assert "rank 1: recipe 'toyproj.recipes:nan_loss': the loss at step 5 is not finite (rank 1: nan)" in proc.stderr
    assert "the newest committed checkpoint, step_00000004 in" in proc.stderr and "is intact" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert read_latest(run_dir / "checkpoints") == "step_00000004"
    assert not (run_dir / "checkpoints" / "step_00000005").exists()
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4]
    assert json.loads((run_dir / "failure.json").read_text())["rank"] == 1


def test_a_bug_in_the_recipe_is_diagnosed_with_where_it_was_hit(tmp_path):
    """Every rank raises a KeyError in the user's loss at step 2: failure.json and the launcher name the exception
    and the line, not "no diagnosis recorded" (found on a GPU machine: a torch API missing from an older release
    ended a launch with nothing recorded, and it was restarted three times)."""
    run_dir = tmp_path / "run"
    proc = submit(make_project(tmp_path, "recipes:bug_in_loss", job={"max_failures": 0}), run_dir)
    assert proc.returncode not in (0, EXIT_USER_ERROR), proc.stdout + proc.stderr
    message = json.loads((run_dir / "failure.json").read_text())["message"]
    assert "KeyError: 'weights' (at " in message and "toyproj/recipes.py:" in message, message
    assert message.endswith(" in loss)"), message
    assert "KeyError: 'weights'" in proc.stderr and "no diagnosis recorded" not in proc.stderr, proc.stderr


def test_mfu_under_a_pipeline_counts_the_whole_models_flops(tmp_path):
    """A recipe with a pipeline and no FLOP figure of its own (pp 2, MFU reported: monitor.peak_tflops): the trainer
    counts the whole model's training FLOPs before cutting it into stages, so each record's MFU gives back exactly
    what FlopCounterMode counts on the bare MLP, per sample."""
    import sys

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    sys.path.insert(0, str(PROJECT.parent))
    try:
        from toyproj.recipes import Points, classify, mlp
    finally:
        sys.path.remove(str(PROJECT.parent))
    model, batch = mlp(32, 0.0), torch.utils.data.default_collate([Points(512)[i] for i in range(4)])
    with FlopCounterMode(display=False) as counter:
        classify(model, batch).backward()
    want = counter.get_total_flops() / 4  # train.micro_batch_size samples

    peak = 1e-6  # TFLOP/s: any figure gives MFU
    config = make_project(tmp_path, "recipes:piped", parallel={"pp": 2}, monitor={"peak_tflops": peak})
    proc = submit(config, tmp_path / "run", "checkpoint.every_steps=0", "checkpoint.at_end=false")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = records(tmp_path / "run")
    assert summary(tmp_path / "run")["parallel"]["pp"] == 2 and len(rows) == 8
    for r in rows:  # mfu = global batch / step time / world x FLOPs per sample / peak
        got = r["mfu"] * peak * 1e12 * r["step_time_s"] * 2 / 16
        assert abs(got - want) < 1e-6 * want, (got, want)


def test_prefetch_hides_a_dataset_slower_than_a_step(tmp_path):
    """Each micro-batch takes 4 x 25 ms to fetch, longer than the 40 ms a micro-batch computes; 4 prefetch threads
    fetch 4 batches at once, so the data wait vanishes, while without prefetch every step waits for its batches."""
    args = {"delay": 0.025, "compute_s": 0.04, "dropout": 0.0}
    config = make_project(tmp_path, "recipes:recipe", args, train={"steps": 14}, checkpoint={"every_steps": 0})
    waits = {}
    for prefetch in (0, 4):
        run_dir = tmp_path / f"prefetch{prefetch}"
        proc = submit(config, run_dir, f"data.prefetch={prefetch}", "checkpoint.at_end=false")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        waits[prefetch] = statistics.median(r["time_data_s"] for r in records(run_dir)[4:])
    assert waits[0] > 0.15, waits  # 2 micro-batches x 100 ms per step
    assert waits[4] < 0.2 * waits[0], waits
    # Same samples in the same order either way: the runs end bit-identical.
    assert summary(tmp_path / "prefetch0")["params_sha256"] == summary(tmp_path / "prefetch4")["params_sha256"]


def test_a_resumed_launch_runs_the_submitted_code(tmp_path, monkeypatch):
    """Editing the project after submit changes nothing for the run; --refresh-code takes the edit on purpose. The
    record (RUN_DIR/record/) holds each submission with the project's commit and, once edited, its diff, and each
    launch's software, nodes and behaviour variables, a credential among them left out."""
    config = make_project(tmp_path, "recipes:recipe", train={"steps": 4})
    project = tmp_path / "proj"
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "toy"]):
        subprocess.run(["git", "-C", str(project), "-c", "user.email=t@example.org", "-c", "user.name=t", *args],
                       check=True, capture_output=True)  # fmt: skip
    head = subprocess.run(["git", "-C", str(project), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("HPC_TEST_TOKEN", "not-to-be-recorded")
    run_dir = tmp_path / "run"
    first = submit(config, run_dir)
    assert first.returncode == 0, first.stdout + first.stderr
    taken = summary(run_dir)["code_sha256"]
    assert taken and len(taken) == 64 and "code snapshot: toyproj" in first.stdout
    submitted = json.loads((run_dir / "record" / "submit-000.json").read_text())
    assert submitted["project"]["commit"] == head.strip() and not submitted["project"]["dirty"], submitted
    assert f"hpc.submit {config} --local --run-dir {run_dir}" in submitted["command"]
    launch = json.loads((run_dir / "record" / "launch-000.json").read_text())
    assert launch["software"]["torch"] == metadata.version("torch") and launch["software"]["mpi"].startswith("MPICH")
    assert [n["ranks"] for n in launch["nodes"].values()] == [[0, 1]] and launch["nodes"]["node0"]["cpu"]
    assert f"torch=={metadata.version('torch')}" in launch["packages"]
    assert launch["environment"]["NCCL_DEBUG"] == "WARN" and "HPC_TEST_TOKEN" not in json.dumps(launch)
    assert "not-to-be-recorded" not in "".join(p.read_text() for p in (run_dir / "record").iterdir())
    edited = tmp_path / "proj" / "toyproj" / "recipes.py"
    edited.write_text(edited.read_text() + "\nraise RuntimeError('edited after submit')\n")

    again = submit(run_dir, None, "train.steps=6", resume=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert summary(run_dir)["final_step"] == 6 and summary(run_dir)["code_sha256"] == taken
    assert history(run_dir)[-2]["code_sha256"] == taken  # the resume event

    refreshed = submit(run_dir, None, "train.steps=8", "--refresh-code", resume=True)
    assert refreshed.returncode == EXIT_USER_ERROR, refreshed.stdout + refreshed.stderr
    assert "RuntimeError: edited after submit" in refreshed.stderr
    assert json.loads((run_dir / "record" / "submit-001.json").read_text())["project"] is None  # snapshot kept
    assert json.loads((run_dir / "record" / "submit-002.json").read_text())["project"]["dirty"]
    assert "+raise RuntimeError('edited after submit')" in (run_dir / "record" / "submit-002.diff").read_text()
    assert sorted(p.name for p in (run_dir / "record").glob("launch-*.json")) == ["launch-000.json", "launch-001.json"]


def test_length_buckets_cut_the_padding_of_a_variable_length_recipe(tmp_path):
    """The same variable-length recipe with and without data.bucket_by_length: the padding (metrics.jsonl
    pad_fraction) falls by more than half, and the checkpoints record the bucketed order (kept on resume)."""
    config = make_project(tmp_path, "recipes:varlen", train={"steps": 12, "log_every": 1})
    runs = {}
    for name, sets in {"plain": [], "buckets": ["data.bucket_by_length=true", "data.bucket_window=4"]}.items():
        proc = submit(config, tmp_path / name, *sets)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[name] = [r["pad_fraction"] for r in records(tmp_path / name)]
    plain, buckets = (sum(v) / len(v) for v in (runs["plain"], runs["buckets"]))
    assert plain > 0.4 and buckets < plain / 2, (plain, buckets)
    listed = run_cli(["-m", "hpc", "runs", str(tmp_path), "--json", "--sort", "name", "--filter", "state=completed"])
    assert listed.returncode == 0, listed.stdout + listed.stderr
    rows = json.loads(listed.stdout)  # the runs of this test, not the project's folders or a code snapshot
    assert [(r["name"], r["step"], r["restarts"]) for r in rows] == [("buckets", 12, 0), ("plain", 12, 0)], rows
    assert all(0 < r["goodput"] <= 1 and r["tokens_per_s"] > 0 and r["loss"] == records(tmp_path / r["name"])[-1][
        "loss"] for r in rows)  # fmt: skip
    png = tmp_path / "compare.png"
    compared = run_cli(["-m", "hpc", "compare", str(tmp_path / "plain"), str(tmp_path / "buckets"), "--out", str(png)])
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert "| data.bucket_by_length | false | true |" in compared.stdout and "| data.bucket_window |" in compared.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = run_cli(["-m", "hpc", "runs", str(tmp_path), "--sort", "mfu"])
    assert bad.returncode == EXIT_USER_ERROR and "--sort 'mfu': sort by one of" in bad.stderr
    print(f"pad_fraction: {plain:.3f} plain, {buckets:.3f} with length buckets")
    order = json.loads((tmp_path / "buckets" / "checkpoints" / read_latest(tmp_path / "buckets" / "checkpoints")
                        / "train_state.json").read_text())["data_order"]  # fmt: skip
    assert order["bucket"] == 4 and order["bucket_window"] == 4 * 16, order
