"""Data preparation, lazy shard reading, and a global sample order that does not depend on the world size."""

import json

import h5py
import numpy as np
import pytest

from tests.conftest import run_cli
from trainer.data.dataset import DataState, GlobalOrder, TokenShards, rank_slice, read_manifest
from trainer.data.prepare import EOS, PrepareSpec, prepare
from trainer.errors import UserError


@pytest.fixture
def text_dir(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for i in range(40):
        (src / ("sub" if i % 2 else "") / f"doc{i:02d}.txt").write_text(f"document {i}\n" + "hello world " * (50 + i))
    (src / "ignored.bin").write_bytes(b"\x00\x01")
    return src


def spec(src, **kw):
    base = {"source": str(src), "include": ("*.txt",), "max_source_bytes": 0, "val_fraction": 0.2, "shard_tokens": 4096}
    return PrepareSpec(**{**base, **kw})


def test_prepare_writes_shards_and_manifest(text_dir, tmp_path):
    out = tmp_path / "data"
    manifest = prepare(spec(text_dir), out)
    assert manifest == read_manifest(out)
    assert manifest["source_files"] == 40
    assert manifest["vocab_size"] == 257 and manifest["tokenizer"] == "bytes"
    assert len(manifest["splits"]["train"]) > 1 and manifest["splits"]["val"]
    total = sum(len(p.read_bytes()) + 1 for p in text_dir.rglob("*.txt"))  # +1: EOS per document
    assert manifest["tokens"]["train"] + manifest["tokens"]["val"] == total
    assert len(manifest["source_sha256"]) == 64
    # the bytes come back: every document of the first train shard is real text followed by EOS
    with h5py.File(out / manifest["splits"]["train"][0]["file"]) as f:
        tokens = f["tokens"][:]
    assert tokens.dtype == np.uint16
    first_doc = tokens[: int(np.argmax(tokens == EOS))].astype(np.uint8).tobytes().decode()
    assert first_doc.startswith("document ")
    # a second prepare of a finished folder is a no-op
    assert prepare(spec(text_dir), out) == manifest


def test_prepare_is_deterministic_and_split_by_path(text_dir, tmp_path):
    a = prepare(spec(text_dir), tmp_path / "a")
    b = prepare(spec(text_dir), tmp_path / "b")
    assert a["splits"] == b["splits"]  # same shards, same checksums
    assert a["source_sha256"] == b["source_sha256"]


def test_max_source_bytes(text_dir, tmp_path):
    manifest = prepare(spec(text_dir, max_source_bytes=3000, val_fraction=0.3), tmp_path / "d")
    assert manifest["source_files"] < 40 and manifest["source_bytes"] <= 3000


def test_prepare_cli(text_dir, tmp_path):
    out = tmp_path / "cli"
    proc = run_cli(
        [
            "-m",
            "trainer.data",
            "prepare",
            "--source",
            str(text_dir),
            "--out",
            str(out),
            "--include",
            "*.txt",
            "--shard-tokens",
            "4096",
            "--val-fraction",
            "0.2",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    assert "prepared 40 files" in proc.stdout
    assert (out / "manifest.json").is_file()
    again = run_cli(["-m", "trainer.data", "prepare", "--source", str(text_dir), "--out", str(out)])
    assert again.returncode == 2 and "already holds" in again.stderr
    missing = run_cli(
        ["-m", "trainer.data", "prepare", "--source", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_windows_are_lazy_and_correct(small_dataset):
    manifest = read_manifest(small_dataset)
    shards = TokenShards(small_dataset, manifest, "train", seq_len=63)
    shards.verify(257)
    assert not shards._files or len(shards._files) == len(manifest["splits"]["train"])
    shards.close()
    lazy = TokenShards(small_dataset, manifest, "train", seq_len=63)
    assert lazy._files == {}
    last = len(lazy) - 1
    window = lazy.sample(last)
    assert window.shape == (64,) and lazy._files.keys() == {len(manifest["splits"]["train"]) - 1}
    # window i of shard 0 is tokens [64 i, 64 i + 64)
    with h5py.File(small_dataset / manifest["splits"]["train"][0]["file"]) as f:
        assert np.array_equal(lazy.sample(3), f["tokens"][192:256])
    lazy.close()


def test_global_order_is_a_seeded_permutation_per_epoch():
    order = GlobalOrder(1000, seed=7)
    e0, e1 = order.take(0, 1000), order.take(1000, 1000)
    assert sorted(e0) == list(range(1000)) and sorted(e1) == list(range(1000))
    assert not np.array_equal(e0, e1)
    assert np.array_equal(GlobalOrder(1000, seed=7).take(0, 1000), e0)
    assert not np.array_equal(GlobalOrder(1000, seed=8).take(0, 1000), e0)
    # reading across the epoch boundary is the concatenation
    assert np.array_equal(order.take(990, 20), np.concatenate([e0[990:], e1[:10]]))


def step_samples(order, position, world, global_batch=24, micro=2):
    accum = global_batch // (micro * world)
    ids = [
        rank_slice(order, position, global_batch=global_batch, micro_batch=micro, world_size=world, rank=r, micro=m)
        for m in range(accum)
        for r in range(world)
    ]
    return np.concatenate(ids)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 12])
def test_step_samples_do_not_depend_on_world_size(world):
    order = GlobalOrder(500, seed=3)
    reference = order.take(0, 24 * 30)
    position = 0
    for step in range(30):  # 30 steps of 24 cross an epoch boundary (500 samples)
        got = step_samples(order, position, world)
        assert np.array_equal(np.sort(got), np.sort(reference[step * 24 : (step + 1) * 24]))
        position += 24


def test_data_state_resumes_the_stream_at_another_world_size():
    """Steps after a save at 2 ranks and a restore at 4 ranks are the uninterrupted run's steps."""
    order = GlobalOrder(100, seed=1)
    state = DataState()
    for _ in range(5):
        step_samples(order, state.position, 2)
        state.position += 24
    restored = DataState()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    fresh = GlobalOrder(100, seed=1)
    for step in range(5, 10):
        got = step_samples(fresh, restored.position, 4)
        assert np.array_equal(np.sort(got), np.sort(order.take(step * 24, 24)))
        restored.position += 24


def test_missing_and_corrupt_data_are_named(small_dataset, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_manifest(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no manifest.json"):
        read_manifest(tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in small_dataset.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    manifest = read_manifest(broken)
    victim = broken / manifest["splits"]["train"][1]["file"]
    victim.write_bytes(victim.read_bytes()[:1000])  # truncated HDF5
    shards = TokenShards(broken, manifest, "train", seq_len=63)
    with pytest.raises(UserError, match=str(victim)):
        shards.verify(257)
