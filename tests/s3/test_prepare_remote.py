"""Preparation straight to object storage: the same shards as a local preparation, the manifest uploaded last, and
a dataset already there left alone."""

from __future__ import annotations

from runconfig.schema import StorageConfig
from storage.objstore import Store
from tests.s3.conftest import BUCKET
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
