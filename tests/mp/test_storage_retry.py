"""Transient storage faults with real processes: checkpoint writes and data reads that fail with EIO (raised at the
real write or read by HPC_INJECT's eio_save and eio_read: trainer/observe/inject.py) are retried with back-off and
the run ends as if nothing happened; a save that keeps failing ends the launch as a crash, never as bad input, and
the previous generation stays intact and loadable.

2 ranks on one node, a small model, 8 steps.
"""

import os
import shutil
import subprocess

import pytest

from rundir.checkpoints import generations, read_latest, validate
from rundir.contract import EXIT_FAILED, EXIT_USER_ERROR, FAILURE_CRASH, INJECT_VAR
from rundir.paths import RunDir
from tests.conftest import PY, ROOT, summary

pytestmark = pytest.mark.mp


def small(data) -> list[str]:
    return [
        f"data.path={data}", "job.nodes=1", "job.ranks_per_node=2", "train.steps=8", "train.warmup_steps=2",
        "train.eval_every=0", "train.global_batch_size=8", "train.micro_batch_size=4", "model.d_model=32",
        "model.n_layers=1", "model.n_heads=2", "model.seq_len=32", "model.dropout=0.1", "checkpoint.every_steps=4",
        "checkpoint.io_retry_backoff_s=0.05", "data.read_retry_backoff_s=0.05", "monitor.tensorboard=false",
    ]  # fmt: skip


def launch(run_dir, sets=(), *, inject="", resume=False) -> subprocess.CompletedProcess:
    args = [PY, "-m", "hpc.submit", *([str(run_dir), "--resume"] if resume else ["tiny", "--run-dir", str(run_dir)])]
    args.append("--local")
    for s in sets:
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT), INJECT_VAR: inject}
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def rank_log(run_dir, rank: int) -> str:
    return (run_dir / "logs" / f"rank_{rank:05d}.log").read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_dataset):
    """The uninterrupted run (generations at steps 4 and 8)."""
    run_dir = tmp_path_factory.mktemp("storage-reference") / "run"
    done = launch(run_dir, small(small_dataset))
    assert done.returncode == 0, done.stdout + done.stderr
    return run_dir


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_transient_write_and_read_errors_are_retried_and_change_nothing(tmp_path, small_dataset, reference, async_save):
    """Rank 0's first two checkpoint file writes (DCP's data file of the step-4 save, twice: the save is retried
    whole, on both ranks; with async_save in the background thread) and rank 1's first two data reads fail with
    EIO."""
    run_dir = tmp_path / "run"
    sets = [*small(small_dataset), f"checkpoint.async_save={async_save}"]
    done = launch(run_dir, sets, inject="eio_save:0:2,eio_read:1:2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(run_dir)["params_sha256"] == summary(reference)["params_sha256"]
    log0, log1 = rank_log(run_dir, 0), rank_log(run_dir, 1)
    for attempt in (1, 2):
        assert f"failed with EIO (Input/output error), attempt {attempt}/6; every rank retries in" in log0, log0
        assert f"failed with EIO (Input/output error), attempt {attempt}/6; retrying in" in log1, log1
    assert "checkpoint at step 4: rank 0: " in log0 and ".tmp-step_00000004/dcp/__0_0.distcp" in log0
    assert "every rank retries" in log1  # rank 1 learned of rank 0's failure and retried with it
    assert "data read of " in log1 and ".h5 failed with EIO" in log1
    assert "attempt 3/6" not in log0 + log1
    assert [s for s, _ in generations(run_dir / "checkpoints")] == [4, 8]
    assert (
        validate(run_dir / "checkpoints" / "step_00000004")["params_sha256"]
        == validate(reference / "checkpoints" / "step_00000004")["params_sha256"]
    )


def test_a_save_that_outlives_its_retries_is_a_crash_and_keeps_the_previous_generation(tmp_path, reference):
    """Resumed at step 8 to train to 12: every checkpoint write of rank 1 fails. After checkpoint.io_retries=1 the
    launch fails (exit status 1, failure.json of kind "failed", not restarted with job.max_failures=0), the step-8
    generation is untouched and still the newest, and a resume from it ends where the uninterrupted run ended."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "summary.json").unlink()
    sets = ["train.steps=12", "checkpoint.io_retries=1", "job.max_failures=0"]
    failed = launch(run_dir, sets, inject="eio_save:1:1000", resume=True)
    assert failed.returncode == EXIT_FAILED != EXIT_USER_ERROR, failed.stdout + failed.stderr
    record = RunDir(run_dir).failure_record()
    assert record["kind"] == FAILURE_CRASH, record
    assert record["message"].startswith("rank 1: checkpoint at step 12 could not be saved: "), record
    assert "Input/output error" in record["message"] and "checkpoint.io_retries=1" in record["message"], record
    assert "attempt 1/2; every rank retries in" in rank_log(run_dir, 1)
    ckpts = run_dir / "checkpoints"
    assert [s for s, _ in generations(ckpts)] == [4, 8] and read_latest(ckpts) == "step_00000008"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000004", "step_00000008"]  # no .tmp-*
    assert validate(ckpts / "step_00000008") == validate(reference / "checkpoints" / "step_00000008")

    done = launch(run_dir, ["train.steps=8"], resume=True)  # the generation loads: nothing left to train
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed from step_00000008" in rank_log(run_dir, 0)
    assert summary(run_dir)["params_sha256"] == summary(reference)["params_sha256"]


def test_a_restore_read_that_outlives_its_retries_is_a_crash_that_names_the_file_and_the_attempts(tmp_path, reference):
    """The newest generation's manifest cannot be read (a real EIO: a link to /proc/self/mem). After
    checkpoint.io_retries=1 the launch fails as a crash whose message names the file and the attempts made (the
    retry's note); the older generation is not taken instead, as if the newest one were corrupt, and nothing is
    deleted."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "summary.json").unlink()
    manifest = run_dir / "checkpoints" / "step_00000008" / "manifest.json"
    manifest.unlink()
    manifest.symlink_to("/proc/self/mem")
    sets = ["train.steps=12", "checkpoint.io_retries=1", "job.max_failures=0"]
    failed = launch(run_dir, sets, resume=True)
    assert failed.returncode == EXIT_FAILED, failed.stdout + failed.stderr
    record = RunDir(run_dir).failure_record()
    assert record["kind"] == FAILURE_CRASH, record
    assert record["message"].startswith(
        f"reading {manifest.parent} failed: [Errno 5] Input/output error: '{manifest}' (gave up after 2 attempt(s) "
    ), record
    assert "(checkpoint.io_retries=1, at most " in record["message"] and "\n" not in record["message"], record
    assert "attempt 1/2; retrying in" in rank_log(run_dir, 0)
    assert "skipping checkpoint" not in rank_log(run_dir, 0)
    assert [s for s, _ in generations(run_dir / "checkpoints")] == [4, 8]
