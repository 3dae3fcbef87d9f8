"""Checkpoints in object storage (checkpoint.storage): committed locally, uploaded with the manifest last, pruned
only after an upload; a run whose run directory lost its checkpoints resumes from the bucket bit-identical; an upload
that is killed leaves the previous generation the bucket's newest; a server restart mid-run is retried."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
import time
import uuid

import pytest

from rundir.checkpoints import generations, manifest_digest
from tests.conftest import history, rank_pids, run_cli, summary, wait_for_step
from tests.mp.exported import assert_export_reproduces_eval
from tests.mp.test_checkpoint import run, start, stopped_by_a_signal
from tests.s3.conftest import BUCKET, sets

pytestmark = pytest.mark.mp
UNIQUE = f"ckpt-{uuid.uuid4().hex[:8]}"  # this session's prefixes: a bucket may hold an earlier session's


def remote(s3, prefix: str, fs=None) -> dict[str, bool]:
    """step name -> whether its manifest is there (``fs``: a client to reuse, for a loop that polls)."""
    fs = fs or s3.fs()
    root = f"{BUCKET}/{prefix}"
    if not fs.exists(root):
        return {}
    names = [e["name"].rsplit("/", 1)[-1] for e in fs.ls(root, detail=True) if e["type"] == "directory"]
    return {n: fs.exists(f"{root}/{n}/manifest.json") for n in sorted(names)}


def test_checkpoints_in_a_bucket_resume_bitwise_without_the_run_directorys(tmp_path, s3, small_dataset, disk_reference):
    run_dir, url = tmp_path / "run", f"s3://{BUCKET}/{UNIQUE}/a"
    args = [*sets(str(small_dataset), tmp_path / "cache"), f"checkpoint.storage={url}", "checkpoint.keep_last=2"]
    stopped = stopped_by_a_signal(run_dir, args, at_step=9, rank=0)
    there = remote(s3, f"{UNIQUE}/a")
    saved = sorted({s for s in range(4, stopped + 1, 4)} | {stopped})
    assert there == {f"step_{s:08d}": True for s in saved[-2:]}, there  # keep_last=2, each committed
    assert [s for s, _ in generations(run_dir / "checkpoints")] == [stopped]  # keep_local=1
    shutil.rmtree(run_dir / "checkpoints")  # the run directory lost them: the bucket has them
    done = run(run_dir, resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    log = (run_dir / "logs" / "rank_00000.log").read_text()
    assert f"checkpoint step_{stopped:08d} downloaded from {url}/step_{stopped:08d}" in log, log
    assert summary(run_dir)["params_sha256"] == summary(disk_reference)["params_sha256"]
    final = remote(s3, f"{UNIQUE}/a")
    assert len(final) == 2 and all(final.values()) and "step_00000016" in final, final
    # the model out of the bucket (a DDP run's): the run's eval loss from the export, in one plain process
    shutil.rmtree(run_dir / "checkpoints")
    exported = assert_export_reproduces_eval(run_dir, tmp_path / "export", from_bucket=True)
    assert exported["generation"] == f"{url}/step_00000016" and exported["params_sha256"]
    # a newer generation someone else wrote (a manifest the run's key does not seal) is passed over, nothing of it read
    fs = s3.fs()
    forged = json.loads(fs.cat_file(f"{BUCKET}/{UNIQUE}/a/step_00000016/manifest.json"))
    forged = {k: v for k, v in forged.items() if k != "run_mac"} | {"step": 99}
    fs.pipe_file(f"{BUCKET}/{UNIQUE}/a/step_00000099/manifest.json", json.dumps(forged).encode())
    again = run_cli(["-m", "trainer.export", str(run_dir), "--from-bucket", "--out", str(tmp_path / "export2")])
    assert again.returncode == 0 and "exported step 16 of" in again.stdout, again.stdout + again.stderr
    assert f"skipping {url}/step_00000099: its manifest is not authenticated by this run's key" in again.stderr
    fs.rm(f"{BUCKET}/{UNIQUE}/a/step_00000099", recursive=True)
    # Another run given the same prefix (a copied config) is refused as it starts, naming both runs; the first
    # run's generations stay as they were.
    other = tmp_path / "other"
    refused = run(other, [*args, "job.nodes=1"])
    assert refused.returncode == 2, refused.stdout + refused.stderr
    owner = json.loads(s3.fs().cat_file(f"{BUCKET}/{UNIQUE}/a/OWNER.json"))
    first = json.loads((run_dir / "identity.json").read_text())["run_id"]
    assert owner["run_dir"] == str(run_dir) and owner["run_id"] == first
    both = f"belongs to run {run_dir} (run id {first[:12]}), not to this run {other}"
    assert f"checkpoint.storage {url} {both}" in refused.stderr, refused.stderr
    assert remote(s3, f"{UNIQUE}/a") == final and not generations(other / "checkpoints")


def test_a_corrupt_object_in_the_bucket_falls_back_and_the_older_generation_reshards(tmp_path, s3, small_dataset):
    """Saved in the background (checkpoint.async_save) by 2 ranks; in the bucket someone rewrote the newest
    generation: its pickled ``.metadata``, with the manifest's SHA-256 and self-checksum made again to match, and a
    file name that climbs out of the download folder; the one before has a damaged object; the run directory's copies
    are gone. The resume on 1 rank skips both (the first not authenticated by the run's key: nothing of it downloaded
    or unpickled; the damaged file removed), downloads the oldest and reshards it; nothing lands outside
    checkpoints/."""
    run_dir, url = tmp_path / "run", f"s3://{BUCKET}/{UNIQUE}/b"
    args = [*sets(str(small_dataset), tmp_path / "cache"), f"checkpoint.storage={url}", "train.steps=12",
            "checkpoint.keep_last=3", "checkpoint.async_save=true"]  # fmt: skip
    done = run(run_dir, args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert remote(s3, f"{UNIQUE}/b") == {f"step_{s:08d}": True for s in (4, 8, 12)}
    fs = s3.fs()
    hostile = f"{BUCKET}/{UNIQUE}/b/step_00000012/manifest.json"
    manifest = json.loads(fs.cat_file(hostile))
    assert "dcp/.metadata" in manifest["files"]
    pickled = f"{BUCKET}/{UNIQUE}/b/step_00000012/dcp/.metadata"
    crafted = b"\x80\x04crafted pickle that must never be loaded"
    fs.pipe_file(pickled, crafted)
    manifest["files"]["dcp/.metadata"] = {"size": len(crafted), "sha256": hashlib.sha256(crafted).hexdigest()}
    manifest["files"]["../../planted.py"] = next(iter(manifest["files"].values()))
    manifest["manifest_sha256"] = manifest_digest(manifest)
    fs.pipe_file(hostile, json.dumps(manifest).encode())
    newest = f"{BUCKET}/{UNIQUE}/b/step_00000008"
    victim = next(f for f in fs.find(newest) if f.endswith(".distcp"))
    data = bytearray(fs.cat_file(victim))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(victim, bytes(data))
    shutil.rmtree(run_dir / "checkpoints")
    again = run(run_dir, ["train.steps=14", "job.nodes=1"], resume=True)  # 1 node x 1 rank
    assert again.returncode == 0, again.stdout + again.stderr
    log = (run_dir / "logs" / "rank_00000.log").read_text()
    assert f"skipping checkpoint {url}/step_00000012: its manifest is not authenticated by this run's key" in log, log
    assert not list(tmp_path.rglob("planted.py")) and not list(tmp_path.rglob(".tmp-step_00000012"))
    assert f"skipping checkpoint s3://{BUCKET}/{UNIQUE}/b/step_00000008:" in log and "(corrupt), removed" in log, log
    assert "checkpoint step_00000004 downloaded" in log, log
    assert "resumed from step_00000004 (step 4, saved by 2 ranks)" in log, log
    assert history(run_dir)[-2]["world_size"] == 1 and summary(run_dir)["final_step"] == 14
    assert fs.exists(f"{newest}/manifest.json")  # nothing was deleted from the bucket


def test_a_server_restart_mid_run_is_retried_and_a_missing_bucket_is_named(tmp_path, s3, small_dataset):
    run_dir = tmp_path / "run"
    args = [*sets(str(small_dataset), tmp_path / "cache"), f"checkpoint.storage=s3://{BUCKET}/{UNIQUE}/c",
            "checkpoint.every_steps=1", "storage.retries=10", "storage.retry_backoff_s=0.2"]  # fmt: skip
    proc = start(run_dir, args)
    wait_for_step(run_dir, 3, proc)
    s3.script("stop")
    threading.Timer(2.0, s3.script, ["start"]).start()
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out + err
    assert all(remote(s3, f"{UNIQUE}/c").values()) and "step_00000016" in remote(s3, f"{UNIQUE}/c")
    bad = run(tmp_path / "bad", [*sets(str(small_dataset), tmp_path / "cache2"),
                                 "checkpoint.storage=s3://no-such-bucket/x", "train.steps=4"])  # fmt: skip
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "no-such-bucket" in bad.stderr and "does not exist" in bad.stderr and "Traceback" not in bad.stderr


def test_a_sigkill_during_an_upload_leaves_the_previous_generation_the_newest(tmp_path, s3, small_dataset,
                                                                             disk_reference):  # fmt: skip
    run_dir, prefix = tmp_path / "run", f"{UNIQUE}/d"
    args = [*sets(str(small_dataset), tmp_path / "cache"), f"checkpoint.storage=s3://{BUCKET}/{prefix}"]
    # each file's upload waits 2 s first: a generation's files are there without its manifest for 2 s or more, a
    # window a poll on a loaded machine (a few S3 requests) cannot miss, as it did at 0.5 s
    proc = start(run_dir, args, inject="slow_upload:0:2,slow_upload:1:2")
    deadline, fs = time.monotonic() + 180, s3.fs()
    while not any(not committed for committed in remote(s3, prefix, fs).values()):  # an upload under way
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    for pid in rank_pids(run_dir).values():
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.communicate(timeout=60)
    there = remote(s3, prefix)
    partial = [n for n, committed in there.items() if not committed]
    assert partial and all(there[n] for n in there if n < partial[0]), there  # older ones committed, it not
    done = run(run_dir, resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(run_dir)["params_sha256"] == summary(disk_reference)["params_sha256"]
    after = remote(s3, prefix)
    assert all(after.values()), after  # the partial one pruned or completed, as every other committed


def test_the_bucket_keeps_the_best_generation_by_an_eval_metric(s3):
    """checkpoint.keep_best in the bucket: the prune after an upload reads the manifests of the generations it would
    delete and keeps the best by the metric (here the highest eval accuracy, a recipe's eval metric, at step 4)."""
    from types import SimpleNamespace

    from runconfig.schema import StorageConfig
    from rundir.checkpoints import Best
    from storage.objstore import Store
    from trainer.checkpoint.remote import RemoteGenerations

    fs, prefix = s3.fs(), f"{UNIQUE}/best"
    accuracy = {2: 0.5, 4: 0.9, 6: 0.7, 8: 0.6, 10: 0.8}
    for step, acc in accuracy.items():
        name = f"step_{step:08d}"
        fs.pipe_file(f"{BUCKET}/{prefix}/{name}/data.bin", b"x")
        body = {"step": step, "eval": {"step": step, "eval_loss": 1.0, "eval_accuracy": acc}, "files": {}}
        fs.pipe_file(f"{BUCKET}/{prefix}/{name}/manifest.json", json.dumps(body).encode())
    remote = RemoteGenerations(store=Store(StorageConfig()), url=f"s3://{BUCKET}/{prefix}",
                               agreement=SimpleNamespace(rank=0, world_size=1), root=None, keep_last=2,
                               keep_every=0, best=Best(1, "eval_accuracy", "max"))  # fmt: skip
    assert sorted(remote.prune()) == ["step_00000002", "step_00000006"]
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/{prefix}")) == [
        "step_00000004", "step_00000008", "step_00000010"]  # fmt: skip
