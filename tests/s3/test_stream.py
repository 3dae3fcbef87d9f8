"""Training from object storage: the shards of a data.path s3:// URL stream through each node's cache (one download
per shard per node, verified), and the run ends bit-identical to the same shards read from disk, across a stop and
resume and a SIGKILL restart too."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import history, rank_pids, summary, wait_for_step
from tests.mp.test_checkpoint import run, start, stopped_by_a_signal
from tests.s3.conftest import sets

pytestmark = pytest.mark.mp


def fetches(cache: Path) -> dict[str, Counter]:
    """node folder -> downloads per shard, from each node's fetches.jsonl."""
    out = {}
    for log in cache.glob("*/*/fetches.jsonl"):
        out[log.parent.parent.name] = Counter(json.loads(line)["file"] for line in log.read_text().splitlines())
    return out


def test_training_from_s3_matches_disk_with_one_download_per_shard_per_node(tmp_path, s3_small, disk_reference_2x2):
    cache = tmp_path / "cache"
    proc = run(tmp_path / "run", sets(s3_small, cache, ranks_per_node=2))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary(tmp_path / "run")["params_sha256"] == summary(disk_reference_2x2)["params_sha256"]
    counts = fetches(cache)
    assert sorted(counts) == ["node0", "node1"], counts  # one cache per (simulated) node, 2 ranks on each
    for node, files in counts.items():
        assert files and max(files.values()) == 1, (node, files)  # every shard at most once per node
        assert any(name.startswith("train_") for name in files), files
    # credentials reach neither the run directory nor its logs
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".yaml", ".log", ".txt", ".md", ".sh"):
            assert "S3RVER" not in path.read_text(errors="replace"), path


def test_a_stop_and_a_sigkill_from_s3_resume_bitwise(tmp_path, s3_small, disk_reference):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    args = sets(s3_small, cache)
    stopped = stopped_by_a_signal(run_dir, args, at_step=5, rank=1)
    # resumed: a SIGKILL of one rank mid-run is restarted in the job from the newest checkpoint
    proc = start(run_dir, ["job.max_failures=2"], resume=True, inject="slow:0:0.1")  # room for the kill
    wait_for_step(run_dir, stopped + 6, proc)
    os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out + err
    events = [e["event"] for e in history(run_dir) if e["event"] != "preflight"]
    assert events.count("restart") == 1 and events[-1] == "done", events
    assert summary(run_dir)["params_sha256"] == summary(disk_reference)["params_sha256"]
    assert all(max(files.values()) == 1 for files in fetches(cache).values())  # the restart reused the caches


def test_a_manifest_naming_a_shard_outside_the_cache_is_refused(tmp_path, s3, small_dataset):
    """A shared bucket's dataset manifest whose shard name climbs out of the node cache (``../``): every rank
    refuses it before fetching anything, naming the shard and the URL; nothing is written outside the cache."""
    manifest = json.loads((small_dataset / "manifest.json").read_text())
    manifest["splits"]["train"][0]["file"] = "../../planted.h5"
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "manifest.json").write_text(json.dumps(manifest))
    url = s3.upload(hostile, "hostile-manifest")
    cache = tmp_path / "cache"
    proc = run(tmp_path / "run", [*sets(url, cache), "job.nodes=1"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"the manifest of {url} names a shard '../../planted.h5'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("planted.h5")) and not (cache.parent.parent / "planted.h5").exists()
