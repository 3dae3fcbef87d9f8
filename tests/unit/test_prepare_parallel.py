"""Parallel preparation (trainer/data/passes.py): the shards are byte-identical whatever the number of worker
processes or tasks, and a preparation killed part-way continues where it stopped instead of starting over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from rundir.contract import INJECT_VAR
from tests.conftest import PY, ROOT
from trainer.data.prepare import PrepareSpec, prepare, work_folder

SPEC = PrepareSpec(source="stdlib", include=("*.py",), max_source_bytes=3_000_000, val_fraction=0.1,
                   shard_tokens=300_000)  # fmt: skip
PART = 256 << 10  # about 12 parts of the 3 MB


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "data"
    return out, prepare(SPEC, out, workers=1, part_bytes=PART)


def shard_bytes(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_workers_and_tasks_give_byte_identical_shards(one_worker, tmp_path):
    out1, manifest1 = one_worker
    assert len(manifest1["splits"]["train"]) >= 8 and manifest1["splits"]["val"]
    many = prepare(SPEC, tmp_path / "many", workers=3, part_bytes=PART)
    assert many == manifest1 and shard_bytes(tmp_path / "many") == shard_bytes(out1)
    # another cut into parts changes nothing either: the shards are cut from the concatenated stream
    other = prepare(SPEC, tmp_path / "other", workers=2, part_bytes=PART * 3)
    assert other == manifest1
    # two tasks (as two Slurm tasks would), sharing one work folder; task 0 writes the dataset
    work, results = tmp_path / "work", {}

    def task(i: int) -> None:
        results[i] = prepare(SPEC, tmp_path / "tasks", workers=1, part_bytes=PART, task=i, tasks=2, work=work)

    threads = [threading.Thread(target=task, args=(i,)) for i in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == {0: manifest1, 1: None}
    assert shard_bytes(tmp_path / "tasks") == shard_bytes(out1)
    assert not work.exists()  # removed once the dataset is complete


def test_a_killed_preparation_continues_where_it_stopped(one_worker, tmp_path):
    out = tmp_path / "data"
    work = work_folder(out, SPEC)
    args = [PY, "-m", "trainer.data", "prepare", "--source", "stdlib", "--out", str(out), "--max-bytes", "3000000",
            "--val-fraction", "0.1", "--shard-tokens", "300000", "--part-mb", "1", "--workers", "1",
            "--include", "*.py"]  # fmt: skip
    slow = {**os.environ, INJECT_VAR: "slow_part:0:0.3"}
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=slow)
    deadline = time.monotonic() + 60
    while not (work / "parts" / "00001.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # nothing half-written where the dataset goes
    done = {p.name: p.stat().st_mtime_ns for p in (work / "parts").glob("*.json")}
    assert "00000.json" in done and "00001.json" in done
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    # the parts done before the kill were not tokenized again ...
    assert f"in 3 parts, {len(done)} done by an earlier attempt with 1 worker(s)" in again.stderr, again.stderr
    # ... and the result is the uninterrupted one, byte for byte (1-MB parts here, 256-KB parts there)
    assert manifest == one_worker[1] and shard_bytes(out) == shard_bytes(one_worker[0])
    assert not work.exists()
