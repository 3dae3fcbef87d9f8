"""A corpus in object storage (``--source s3://bucket/prefix``), brought into the preparation's work folder.

The objects under the prefix that match ``include`` (and the lengths files of matched token files) are listed,
their names checked (storage/safepath.py: a remote name becomes a local path only under the folder), then
downloaded, each under a temporary name and renamed, in threads; an object
already there with its size is not fetched again, so a killed preparation resumes. With Slurm tasks each fetches
object i with i % tasks == task and waits for the others' (the work folder is on a file system all of them see).
The preparation then reads the copy as a local folder, so its shards are the ones a local copy of the same objects
gives.
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from storage.objstore import Store, StoreError
from storage.safepath import UnsafeName, safe_join
from trainer.data.formats import LENGTHS_SUFFIX, CorpusError

#: Downloads at once.
THREADS = 8


def fetch(url: str, include: tuple[str, ...], max_bytes: int, dest: Path, store: Store, *, task: int = 0,
          tasks: int = 1, poll_s: float = 0.5) -> Path:  # fmt: skip
    """The objects of ``url`` that the preparation takes, copied under ``dest``; returns ``dest``. FileNotFoundError
    when none matches, CorpusError for a name that cannot be a local path, StoreError from the store."""
    objects = _listing(url, store)
    matchers = [re.compile(fnmatch.translate(p)).match for p in include]
    taken, total = [], 0
    for rel, size in sorted(objects.items()):
        name = rel.rsplit("/", 1)[-1]
        if rel.endswith(LENGTHS_SUFFIX) or not any(m(rel) or m(name) for m in matchers):
            continue
        if max_bytes and total + size > max_bytes and taken:
            break
        taken.append(rel)
        total += size
    if not taken:
        raise FileNotFoundError(f"data source {url} has no objects matching {list(include)}")
    sides = [s for rel in taken if (s := rel.rsplit(".", 1)[0] + LENGTHS_SUFFIX) in objects]
    wanted = [(rel, objects[rel], _local(dest, url, rel)) for rel in taken + sides]
    mine = [w for i, w in enumerate(wanted) if i % tasks == task and not _present(w[2], w[1])]
    with ThreadPoolExecutor(THREADS) as pool:
        for _ in pool.map(lambda w: _download(url, store, *w), mine):
            pass
    while not all(_present(path, size) for _, size, path in wanted):  # the other tasks' share
        time.sleep(poll_s)
    return dest


def _listing(url: str, store: Store) -> dict[str, int]:
    """{name relative to the prefix: size} of every object under ``url``."""

    def find(fs, path):  # noqa: ANN001, ANN202
        return {name: int(info.get("size") or 0) for name, info in fs.find(path, detail=True).items()}

    found = store.call(find, url, what="data source listing")
    _, prefix = store.fs(url)
    prefix = prefix.rstrip("/") + "/"
    return {name[len(prefix) :]: size for name, size in found.items() if name.startswith(prefix)}


def _local(dest: Path, url: str, rel: str) -> Path:
    try:
        return safe_join(dest, rel)
    except UnsafeName as exc:
        raise CorpusError(f"data source {url}: object {exc} and cannot be a local file's name; rename it or leave it "
                          "out with --include") from None  # fmt: skip


def _present(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


def _download(url: str, store: Store, rel: str, size: int, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.part-{os.getpid()}")
    source = url.rstrip("/") + "/" + rel
    store.download(source, str(tmp), what="data source object")
    got = tmp.stat().st_size
    if got != size:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"data source object {source}: {got} bytes downloaded, the listing said {size}; it "
                         "changed while it was read")  # fmt: skip
    os.replace(tmp, path)
