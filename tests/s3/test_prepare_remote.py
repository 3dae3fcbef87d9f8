"""Preparation straight to object storage: the same shards as a local preparation, the manifest uploaded last, and
a dataset already there left alone; and from object storage: the shards of a local copy, hostile names refused."""

from __future__ import annotations

import dataclasses

import pytest

from runconfig.schema import StorageConfig
from storage.objstore import Store
from tests.s3.conftest import BUCKET
from tests.unit.test_corpus_formats import corpus
from trainer.data.formats import CorpusError
from trainer.data.prepare import PrepareSpec, prepare
from trainer.data.resolve import remote_manifest

SPEC = PrepareSpec(source="stdlib", include=("*.py",), max_source_bytes=1_500_000, val_fraction=0.1,
                   shard_tokens=300_000)  # fmt: skip


def test_prepare_to_a_bucket_writes_the_local_shards(s3, tmp_path):
    local = prepare(SPEC, tmp_path / "local", workers=1, part_bytes=256 << 10)
    url = f"s3://{BUCKET}/prepared"
    remote = prepare(SPEC, url, workers=2, part_bytes=256 << 10, work=tmp_path / "work")
    assert remote == local
    manifest, sizes = remote_manifest(Store(StorageConfig()), url)
    assert manifest == local
    fs = s3.fs()
    for split in local["splits"].values():
        for shard in split:
            want = (tmp_path / "local" / shard["file"]).read_bytes()
            assert fs.cat_file(f"{BUCKET}/prepared/{shard['file']}") == want
    assert not (tmp_path / "work").exists()
    # a complete dataset at the URL is returned as it is, nothing prepared again
    assert prepare(SPEC, url, workers=1, work=tmp_path / "work2") == local and not (tmp_path / "work2").exists()


def test_prepare_from_a_bucket_gives_the_shards_of_a_local_copy(s3, tmp_path):
    src = corpus(tmp_path)  # JSON lines (plain, .gz, .zst), Parquet and an Arrow folder
    fs = s3.fs()
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        fs.put_file(str(path), f"{BUCKET}/corpus/{path.relative_to(src)}")
    spec = PrepareSpec(source=f"s3://{BUCKET}/corpus", include=("*.jsonl*", "*.parquet", "*.arrow"),
                       max_source_bytes=0, val_fraction=0.2, shard_tokens=4096)  # fmt: skip
    remote = prepare(spec, tmp_path / "remote", workers=2, part_bytes=2048)
    local = prepare(dataclasses.replace(spec, source=str(src)), tmp_path / "local", workers=1)
    assert remote["splits"] == local["splits"] and remote["source_sha256"] == local["source_sha256"]
    assert remote["source"] == f"s3://{BUCKET}/corpus" and remote["source_files"] == 5
    assert not list(tmp_path.glob(".remote.prepare-*"))  # the copy went with the work folder

    # a key that cannot be a local name is refused by name, before anything is read (s3rver keeps a backslash as it
    # was sent; a '..' segment the client already resolves, though AWS would keep it: storage/safepath.py refuses both)
    fs.pipe_file(f"{BUCKET}/hostile/a.jsonl", b'{"text": "fine"}\n')
    fs.pipe_file(f"{BUCKET}/hostile/x\\..\\escape.jsonl", b'{"text": "no"}\n')
    hostile = dataclasses.replace(spec, source=f"s3://{BUCKET}/hostile", include=("*.jsonl",))
    with pytest.raises(CorpusError, match=r"hostile: object 'x\\\\\.\.\\\\escape\.jsonl' holds a NUL or a backslash"):
        prepare(hostile, tmp_path / "hostile")
    assert not (tmp_path / "hostile").exists() and not list(tmp_path.glob(".hostile.prepare-*/source/*"))
