"""Object storage that is wrong or failing, against the real server: each fault is one message naming the URL, key,
shard or rank, or a retry that outlives a server restart; nothing half-downloaded is ever taken for a shard."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from runconfig.schema import StorageConfig
from storage import objstore
from storage.objstore import Store, StoreError, StoreUnavailable
from tests.conftest import PY, ROOT, as_user
from tests.s3.conftest import BUCKET
from trainer.data.node_cache import FETCHES, NodeCache
from trainer.data.resolve import remote_manifest
from trainer.errors import UserError

FAST = StorageConfig(retries=2, retry_backoff_s=0.05)


def cache_of(url: str, folder: Path, **kw) -> NodeCache:
    store = Store(FAST)
    manifest, sizes = remote_manifest(store, url)
    return NodeCache(store, url, manifest, folder, max_bytes=kw.pop("max_bytes", 0), threads=2, rank=0,
                      sizes=sizes, **kw)  # fmt: skip


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def train_files(url: str) -> list[str]:
    return [s["file"] for s in remote_manifest(Store(FAST), url)[0]["splits"]["train"]]


def test_an_unreachable_endpoint_is_named(s3_small):
    store = Store(StorageConfig(endpoint_url="http://127.0.0.1:9", retries=1, retry_backoff_s=0.01))
    with pytest.raises(UserError, match=r"data.path s3://hpc-test/small: the object store cannot be reached .*"
                                        r"http://127.0.0.1:9 unavailable.* check storage.endpoint_url"):  # fmt: skip
        remote_manifest(store, s3_small)


def test_wrong_or_missing_credentials_are_named(s3_small, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "WRONG")
    with pytest.raises(UserError, match=r"s3://hpc-test/small/manifest.json \(data.path\): access denied by "
                                        r"http://127.0.0.1:\d+ .*credentials in the environment"):  # fmt: skip
        remote_manifest(Store(FAST), s3_small)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(UserError, match="no credentials were found for http://127.0.0.1:.* set AWS_ACCESS_KEY_ID"):
        remote_manifest(Store(FAST), s3_small)


def test_a_missing_bucket_or_prefix_is_named(s3):
    with pytest.raises(UserError, match="bucket 'no-such-bucket' does not exist at http://127.0.0.1"):
        remote_manifest(Store(FAST), "s3://no-such-bucket/data")
    with pytest.raises(UserError, match="data.path s3://hpc-test/nothing has no manifest.json: it is not a prepared"):
        remote_manifest(Store(FAST), f"s3://{BUCKET}/nothing")


def test_a_missing_shard_or_a_manifest_unlike_the_shards_is_named(s3, small_dataset):
    url = s3.upload(small_dataset, "missing-shard")
    victim = train_files(url)[1]
    s3.fs().rm_file(f"{BUCKET}/missing-shard/{victim}")
    with pytest.raises(UserError, match=f"data shard {url}/{victim}, listed in {url}/manifest.json, is missing"):
        remote_manifest(Store(FAST), url)
    url = s3.upload(small_dataset, "wrong-size")
    manifest = json.loads((small_dataset / "manifest.json").read_text())
    manifest["splits"]["train"][0]["bytes"] += 1
    s3.fs().pipe_file(f"{BUCKET}/wrong-size/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(UserError, match=f"holds {manifest['splits']['train'][0]['bytes'] - 1} bytes, but "
                                        f"{url}/manifest.json says"):  # fmt: skip
        remote_manifest(Store(FAST), url)


def test_a_corrupt_shard_in_the_bucket_is_never_cached(s3, small_dataset, tmp_path):
    url = s3.upload(small_dataset, "corrupt")
    victim = train_files(url)[0]
    data = bytearray((small_dataset / victim).read_bytes())
    data[-100] ^= 0xFF
    s3.fs().pipe_file(f"{BUCKET}/corrupt/{victim}", bytes(data))
    cache = cache_of(url, tmp_path / "cache")
    with pytest.raises(UserError, match=f"rank 0: data shard {url}/{victim} failed its checksum after download"):
        cache.local(victim)
    assert not (tmp_path / "cache" / victim).exists() and not list((tmp_path / "cache").glob(".part-*"))
    cache.close()


def test_a_server_restart_mid_fetch_is_retried(s3, s3_small, tmp_path):
    store = Store(StorageConfig(retries=8, retry_backoff_s=0.2))
    manifest, sizes = remote_manifest(store, s3_small)
    cache = NodeCache(store, s3_small, manifest, tmp_path / "cache", max_bytes=0, threads=1, rank=0, sizes=sizes)
    name = manifest["splits"]["train"][0]["file"]
    s3.script("stop")
    restarted = threading.Timer(1.5, s3.script, ["start"])
    restarted.start()
    try:
        started = time.monotonic()
        path = cache.local(name)  # refused connections, retried with back-off until the server is back
        assert time.monotonic() - started > 1.0
        assert path.stat().st_size == sizes[name]
    finally:
        restarted.join()
        cache.close()
    # ... and with too few retries it is a transient error: the launch crashes and the launcher restarts it
    s3.script("stop")
    try:
        with pytest.raises(StoreUnavailable):
            Store(StorageConfig(retries=1, retry_backoff_s=0.01)).read_bytes(f"{s3_small}/manifest.json", what="x")
    finally:
        s3.script("start")


def test_the_node_cache_evicts_least_recently_used_and_names_a_full_disk(s3_small, tmp_path):
    files = train_files(s3_small)
    store = Store(FAST)
    manifest, sizes = remote_manifest(store, s3_small)
    bound = sizes[files[0]] + sizes[files[1]] + sizes[files[2]] // 2  # two shards fit, not three
    cache = NodeCache(store, s3_small, manifest, tmp_path / "c", max_bytes=bound, threads=1, rank=0, sizes=sizes)
    cache.local(files[0])
    time.sleep(0.01)
    cache.local(files[1])
    time.sleep(0.01)
    cache.local(files[0])  # used again: files[1] is now the least recently used
    cache.local(files[2])
    present = {p.name for p in (tmp_path / "c").iterdir() if p.name.startswith("train_")}
    assert present == {files[0], files[2]}, present
    cache.close()
    # a disk smaller than one shard: one message naming the cache folder and what to do
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        cache = NodeCache(store, s3_small, manifest, small / "node0" / "c", max_bytes=0, threads=1, rank=0, sizes=sizes)
        with pytest.raises(UserError, match=r"the node cache .*small/node0/c \(data.cache_dir\) is full: data shard"):
            cache.local(files[0])
        assert not list((small / "node0" / "c").glob(".part-*"))
        cache.close()
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


FETCH_ALL = """
import sys
from storage.objstore import Store
from runconfig.schema import StorageConfig
from trainer.data.resolve import remote_manifest
from trainer.data.node_cache import NodeCache
url, folder = sys.argv[1], sys.argv[2]
store = Store(StorageConfig())
manifest, sizes = remote_manifest(store, url)
cache = NodeCache(store, url, manifest, folder, max_bytes=0, threads=3, rank=0, sizes=sizes)
names = [s["file"] for s in manifest["splits"]["train"]]
cache.will_need(names)
print(sum(cache.local(n).stat().st_size for n in names))
cache.close()
"""


def test_two_runs_sharing_a_cache_folder_download_each_shard_once(s3_small, tmp_path):
    folder = tmp_path / "shared"
    procs = [
        subprocess.Popen([PY, "-c", FETCH_ALL, s3_small, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    totals = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs) and len(set(totals)) == 1
    fetched = [json.loads(line)["file"] for line in (folder / FETCHES).read_text().splitlines()]
    assert sorted(fetched) == sorted(train_files(s3_small)), fetched  # each once, whoever fetched it


def test_a_download_in_ranges_is_the_object_hashed_as_it_arrived(s3, tmp_path, monkeypatch):
    """Store.download_hashed (checkpoint restores): the object in several ranges, fetched a few at a time, written
    in order, its SHA-256 that of the bytes written; an object shorter than expected, or missing, is named."""
    monkeypatch.setattr(objstore, "RANGE_BYTES", 1000)
    fs, store = s3.fs(), Store(FAST)
    data = os.urandom(5_500)
    for n in (0, 999, 1_000, 5_500):
        fs.pipe_file(f"{BUCKET}/ranges/o{n}", data[:n])
        dest = tmp_path / f"o{n}"
        assert store.download_hashed(f"s3://{BUCKET}/ranges/o{n}", str(dest), n, what="x") == sha256(data[:n])
        assert dest.read_bytes() == data[:n]
    with pytest.raises(StoreError, match=f"x s3://{BUCKET}/ranges/o999: the object is shorter than the 1000 bytes"):
        store.download_hashed(f"s3://{BUCKET}/ranges/o999", str(tmp_path / "short"), 1_000, what="x")
    for n in (0, 10):
        with pytest.raises(StoreError, match=f"x s3://{BUCKET}/ranges/none: no such object"):
            store.download_hashed(f"s3://{BUCKET}/ranges/none", str(tmp_path / "none"), n, what="x")


def test_store_errors_name_the_url(s3):
    with pytest.raises(StoreError, match=f"checkpoint s3://{BUCKET}/none/x \\(checkpoint.storage\\): no such object"):
        Store(FAST).read_bytes(f"s3://{BUCKET}/none/x", what="checkpoint", key="checkpoint.storage")


def test_a_shared_cache_folder_of_another_user_or_a_planted_shard_is_never_used(s3_small, other_user, shared_scratch):
    """data.cache_dir on a shared scratch disk: the node folder another user made first is refused, naming them;
    this user's folders are 0700 (the other user cannot plant a shard in them); a bad copy found in the cache (a
    crafted file, a link) is removed and downloaded again, and no link is followed."""
    store = Store(FAST)
    manifest, sizes = remote_manifest(store, s3_small)
    name = train_files(s3_small)[0]
    taken = shared_scratch / "node0"  # data.cache_dir=shared_scratch: the other user's run made node0 first
    assert as_user(other_user, ["mkdir", "-m", "755", str(taken)]).returncode == 0
    with pytest.raises(UserError, match=f"node cache .*{taken} belongs to {other_user.pw_name} .*, not to you"):
        NodeCache(store, s3_small, manifest, taken / "key", max_bytes=0, threads=1, rank=0, sizes=sizes)
    assert list(taken.iterdir()) == []

    folder = shared_scratch / "mine" / "node0" / "key"
    cache = NodeCache(store, s3_small, manifest, folder, max_bytes=0, threads=1, rank=0, sizes=sizes)
    good = cache.local(name).read_bytes()
    cache.close()
    assert all((p.stat().st_mode & 0o777) == 0o700 for p in (folder.parent.parent, folder.parent, folder))
    planted = as_user(
        other_user, ["sh", "-c", f"echo x > {folder}/{name}.new && mv {folder}/{name}.new {folder}/{name}"]
    )
    assert planted.returncode != 0 and (folder / name).read_bytes() == good  # 0700: nothing planted
    # Bad copies in the cache all the same (an old version's folder, a damaged disk): a crafted shard, and a link to
    # a private file of this user's. Each is checked before its first use, removed, downloaded again.
    secret = shared_scratch / "private.txt"
    secret.write_text("this user's own file")
    (folder / name).write_bytes(b"crafted" + good[7:])
    others = train_files(s3_small)[1]
    (folder / others).symlink_to(secret)
    cache = NodeCache(store, s3_small, manifest, folder, max_bytes=0, threads=1, rank=0, sizes=sizes)
    assert cache.local(name).read_bytes() == good
    assert not cache.local(others).is_symlink() and secret.read_text() == "this user's own file"
    cache.close()
    fetched = [json.loads(line)["file"] for line in (folder / FETCHES).read_text().splitlines()]
    assert sorted(fetched) == sorted([name, name, others]), fetched  # downloaded again, not taken as found
    # A checked copy is known by its record (size, inode, time): another process does not download it again.
    cache = NodeCache(store, s3_small, manifest, folder, max_bytes=0, threads=1, rank=0, sizes=sizes)
    assert cache.local(name).read_bytes() == good
    cache.close()
    assert len((folder / FETCHES).read_text().splitlines()) == 3
    folder.chmod(0o777)  # this user's cache made writable by all: never used again as it is
    with pytest.raises(UserError, match=f"node cache .*{folder} may be written by others \\(mode 777\\)"):
        NodeCache(store, s3_small, manifest, folder, max_bytes=0, threads=1, rank=0, sizes=sizes)
