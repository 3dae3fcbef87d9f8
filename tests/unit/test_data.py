"""Data preparation, lazy shard reading, and a global sample order that does not depend on the world size."""

import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from runconfig.schema import StorageConfig
from rundir.contract import EXIT_USER_ERROR
from storage.ioretry import RetryPolicy
from storage.objstore import Store
from tests.conftest import run_cli
from trainer.data.dataset import TokenShards, _Raw, read_manifest
from trainer.data.node_cache import NodeCache
from trainer.data.prepare import EOS, PrepareSpec, prepare
from trainer.data.verify import check_checksums, check_vocab, shards_of_rank
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
    assert again.returncode == EXIT_USER_ERROR and "already holds" in again.stderr
    missing = run_cli(
        ["-m", "trainer.data", "prepare", "--source", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]
    )
    assert missing.returncode == EXIT_USER_ERROR and "does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_windows_are_lazy_and_correct(small_dataset):
    manifest = read_manifest(small_dataset)
    shards = TokenShards(small_dataset, manifest, "train", seq_len=63)
    shards.verify()
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


def test_prepared_shards_are_read_with_pread_and_other_layouts_with_h5py(small_dataset, tmp_path):
    """Prepared shards are contiguous: a window is one pread on HDF5's own descriptor, equal to h5py's slice for
    every window. A chunked, compressed shard (written by another tool) is read by h5py, window for window alike."""
    manifest = copy_dataset(small_dataset, tmp_path / "data")
    first = manifest["splits"]["train"][0]
    with h5py.File(tmp_path / "data" / first["file"]) as f:
        tokens = f["tokens"][:]
    fast = TokenShards(tmp_path / "data", manifest, "train", seq_len=63)
    count = int(fast.starts[1])
    want = [tokens[64 * i : 64 * i + 64].astype(np.int64) for i in range(count)]
    assert all(np.array_equal(fast[i], w) for i, w in zip(range(count), want, strict=True))
    assert fast._raw[0] is not None and fast._raw[0].fd == fast._files[0].file.id.get_vfd_handle()
    fast.close()
    with h5py.File(tmp_path / "data" / first["file"], "w") as f:
        f.create_dataset("tokens", data=tokens, chunks=(1000,), compression="gzip")
    slow = TokenShards(tmp_path / "data", manifest, "train", seq_len=63)
    assert all(np.array_equal(slow[i], w) for i, w in zip(range(count), want, strict=True))
    assert 0 in slow._files and slow._raw[0] is None
    slow.close()


def test_node_cache_shards_are_memory_mapped_and_read_window_for_window_alike(small_dataset, tmp_path):
    """A shard in the node cache is mapped once open, and every window is the one pread reads in place; a shard
    dropped (no longer needed) is mapped again on its next read, and a window taken before is a copy of its own."""
    manifest = read_manifest(small_dataset)
    local = TokenShards(small_dataset, manifest, "train", seq_len=63)
    url = str(small_dataset)  # a plain path: the local file system stands in for the bucket
    cache = NodeCache(Store(StorageConfig()), url, manifest, tmp_path / "node0" / "c", max_bytes=0, threads=2,
                      rank=0, sizes={s["file"]: (small_dataset / s["file"]).stat().st_size
                                     for s in manifest["splits"]["train"]})  # fmt: skip
    cached = TokenShards(tmp_path / "node0" / "c", manifest, "train", seq_len=63, cache=cache, check_range=False)
    step = max(1, len(local) // 3000)
    before = cached[0]
    assert set(cached._mapped) == {0} and cached._mapped[0].dtype == np.uint16
    assert all(np.array_equal(cached[i], local[i]) for i in range(0, len(local), step))
    assert cached[len(local) - 1].dtype == np.int64 and np.array_equal(cached[len(local) - 1], local[len(local) - 1])
    cached.will_need([])  # nothing needed: every shard closed, its mapping dropped
    assert cached._mapped == {} and cached._files == {}
    assert np.array_equal(before, local[0]) and np.array_equal(cached[0], local[0]) and 0 in cached._mapped
    cached.close()
    cache.close()
    local.close()


def test_a_mapping_is_refused_for_a_file_shorter_than_its_tokens(small_dataset, tmp_path):
    manifest = copy_dataset(small_dataset, tmp_path / "data")
    victim = tmp_path / "data" / manifest["splits"]["train"][0]["file"]
    with h5py.File(victim, "r") as f:
        raw = _Raw.of(f["tokens"])
        assert raw is not None and raw.mapped() is not None
        os.truncate(victim, victim.stat().st_size - 4096)
        assert raw.mapped() is None  # mapped, a read past the end would be a SIGBUS; pread names it instead


def test_a_shard_cut_short_under_an_open_handle_is_named_not_read_as_garbage(small_dataset, tmp_path):
    manifest = copy_dataset(small_dataset, tmp_path / "data")
    victim = tmp_path / "data" / manifest["splits"]["train"][0]["file"]
    shards = TokenShards(tmp_path / "data", manifest, "train", seq_len=63, retry=RetryPolicy(1, 0.01, "x"))
    shards[0]  # open, its layout known
    last = int(shards.starts[1]) - 1
    os.truncate(victim, victim.stat().st_size - 4096)
    with pytest.raises(UserError, match=f"data shard {victim} is not a readable HDF5 token file"):
        shards[last]  # the short read is retried on a fresh open, which HDF5 refuses: truncated
    shards.close()


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
        shards.verify()


def copy_dataset(src: Path, dst: Path) -> dict:
    shutil.copytree(src, dst)
    return read_manifest(dst)


def flip_high_byte(shard: Path, token: int) -> int:
    """Flip the high byte of token ``token`` in a shard file, in place (as a bad disk or a stray write would);
    return the token's new value (>= 256: outside a byte vocabulary)."""
    with h5py.File(shard, "r") as f:
        at = f["tokens"].id.get_offset() + 2 * token + 1  # uint16 little-endian: the high byte is the second
    with open(shard, "r+b") as fh:
        fh.seek(at)
        old = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([old ^ 0xFF]))
    with h5py.File(shard, "r") as f:
        return int(f["tokens"][token])


def test_checksums_are_split_over_ranks_and_a_changed_byte_is_named(small_dataset, tmp_path):
    manifest = copy_dataset(small_dataset, tmp_path / "data")
    everything = [*manifest["splits"]["train"], *manifest["splits"]["val"]]
    shares = [shards_of_rank(manifest, r, 4) for r in range(4)]
    assert sorted(s["file"] for share in shares for s in share) == sorted(s["file"] for s in everything)
    assert shares[1][0] == manifest["splits"]["train"][1]  # shard i goes to rank i % world size
    for r, share in enumerate(shares):
        check_checksums(tmp_path / "data", share, r)  # a clean copy passes
    victim = tmp_path / "data" / manifest["splits"]["train"][1]["file"]
    assert flip_high_byte(victim, 1000) >= 256
    with pytest.raises(UserError) as info:
        check_checksums(tmp_path / "data", shares[1], 1)
    message = str(info.value)
    assert message.startswith("rank 1: ") and f"data shard {victim}" in message
    assert manifest["splits"]["train"][1]["sha256"] in message and "prepare the data again" in message
    shards = TokenShards(tmp_path / "data", manifest, "train", seq_len=63)
    shards.verify()  # the cheap checks cannot see a changed byte
    shards.close()


def test_size_and_dtype_must_match_the_manifest(small_dataset, tmp_path):
    manifest = copy_dataset(small_dataset, tmp_path / "data")
    victim = tmp_path / "data" / manifest["splits"]["train"][0]["file"]
    with h5py.File(victim, "r") as f:
        tokens = f["tokens"][:]
    for data in (tokens[:-7], tokens.astype(np.int32)):  # a shorter shard; the same tokens in another dtype
        with h5py.File(victim, "w") as f:
            f.create_dataset("tokens", data=data)
        shards = TokenShards(tmp_path / "data", manifest, "train", seq_len=63)
        with pytest.raises(UserError, match=f"data shard {victim} holds {data.dtype}") as info:
            shards.verify()
        assert f"uint16[{len(tokens)}]" in str(info.value)
        shards.close()


def test_vocabulary_larger_than_the_model_is_refused(small_dataset):
    manifest = read_manifest(small_dataset)
    check_vocab(small_dataset, manifest, 257)
    check_vocab(small_dataset, manifest, 512)
    with pytest.raises(UserError) as info:
        check_vocab(small_dataset, manifest, 256)
    message = str(info.value)
    assert "model.vocab_size=256" in message and f"vocab_size=257 in {small_dataset / 'manifest.json'}" in message


def test_window_with_a_token_outside_the_vocabulary_is_named(small_dataset, tmp_path):
    manifest = copy_dataset(small_dataset, tmp_path / "data")
    victim = tmp_path / "data" / manifest["splits"]["train"][1]["file"]
    shards = TokenShards(tmp_path / "data", manifest, "train", seq_len=63, rank=3)
    first = int(shards.starts[1])  # the first window of shard 1: its tokens [0, 64)
    value = flip_high_byte(victim, 70)  # inside the second window
    assert shards.sample(first).max() < 257  # the window before it still reads
    with pytest.raises(UserError) as info:
        shards[first + 1]
    message = str(info.value)
    assert message.startswith("rank 3: ") and f"data shard {victim}" in message
    assert f"token {value} at token offset 70" in message and "vocabulary of 257" in message
    shards.close()


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--shard-tokens", "0", "argument --shard-tokens: must be an integer >= 1024, got '0'"),
        ("--shard-tokens", "-5", "argument --shard-tokens"),
        ("--max-bytes", "-1", "argument --max-bytes: must be an integer >= 0"),
        ("--val-fraction", "0", "argument --val-fraction: must be a number in (0, 1)"),
        ("--val-fraction", "1.5", "argument --val-fraction"),
        ("--val-fraction", "nan", "argument --val-fraction"),
    ],
)
def test_prepare_cli_refuses_bad_numbers_before_any_work(tmp_path, flag, value, needle):
    out = tmp_path / "out"
    args = ["-m", "trainer.data", "prepare", "--source", "stdlib", "--out", str(out), flag, value]
    proc = run_cli(args, timeout=60)  # shard_tokens=0 used to loop forever
    assert proc.returncode == EXIT_USER_ERROR and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize(
    "field,value", [("shard_tokens", 0), ("max_source_bytes", -1), ("val_fraction", 1.0), ("include", ())]
)
def test_prepare_spec_refuses_bad_arguments(field, value):
    with pytest.raises(ValueError, match=field):
        spec("stdlib", **{field: value})
