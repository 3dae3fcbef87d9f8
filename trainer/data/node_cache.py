"""A node-local cache of a remote dataset's shards: each shard downloaded once per node whatever the number of ranks
on it, verified against the manifest's SHA-256, written atomically, fetched ahead of the order by background
threads, and evicted least-recently-used under a size bound.

Layout: ``CACHE_DIR/<node>/<dataset key>/`` (both folders the user's own, 0700: storage/private.py) holds the shards
under their own names, ``.locks/<name>`` (one flock per shard: the rank that holds it downloads, the others on the
node wait and find the file), ``.verified/<name>`` (the size, inode and time of a copy whose SHA-256 was checked: a
copy found in the cache is hashed again unless it is that very file), ``.part-*`` (a download in progress; a killed
one is removed by the next process) and ``fetches.jsonl`` (one line per download, which the tests and the benchmark
count). The key is a digest of the dataset's URL and manifest, so two runs on
one dataset share it, and a changed dataset is a new folder. Per node: a file lock is only reliable between
processes of one host, and a cache on a shared file system would otherwise be a second copy that serves nobody.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from storage.digest import sha256_file
from storage.files import append_jsonl, write_json_atomic
from storage.objstore import Store, StoreError, join
from storage.private import UnsafeFolder, private_dir
from trainer.errors import UserError

T = TypeVar("T")
log = logging.getLogger(__name__)
FETCHES = "fetches.jsonl"
_CHUNK = 8 << 20


def dataset_key(url: str, manifest: dict) -> str:
    text = url.rstrip("/") + "\0" + json.dumps(manifest, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class NodeCache:
    """Local copies of the shards of the dataset at ``url`` (manifest ``manifest``) in ``folder``."""

    def __init__(
        self,
        store: Store,
        url: str,
        manifest: dict,
        folder: Path,
        *,
        max_bytes: int,
        threads: int,
        rank: int,
        sizes: dict[str, int] | None = None,
    ) -> None:
        self.store, self.url, self.folder, self.rank = store, url.rstrip("/"), Path(folder), rank
        self.max_bytes = max_bytes
        self.expected = {s["file"]: s.get("sha256") for split in manifest["splits"].values() for s in split}
        self.sizes = sizes or {}
        what = f"rank {rank}: the node cache (data.cache_dir)"
        try:
            for folder in (self.folder.parent, self.folder, self.folder / ".locks", self.folder / ".verified"):
                private_dir(folder, what=what)
        except UnsafeFolder as exc:
            raise UserError(str(exc), collective=False) from None
        self._verified: set[str] = set()  # names this process checked (or downloaded) this launch
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="shard-fetch")
        self._pending: dict[str, Future] = {}
        self._wanted: set[str] = set()  # this process's upcoming shards: never evicted by it
        self._mutex = threading.Lock()
        self._remove_dead_parts()

    def local(self, name: str) -> Path:
        """The local copy of shard ``name``, downloaded now if no process on this node has it yet. A copy found in the
        cache is checked against the manifest's SHA-256 before this process first uses it (unless it is the very
        file a check recorded): one that fails is removed and downloaded again."""
        final = self.folder / name
        if name in self._verified or self._found_good(name, final):
            with contextlib.suppress(OSError):
                os.utime(final)  # most recently used
            if final.is_file():
                return final
        with self._mutex:
            pending = self._pending.get(name)
        if pending is not None:
            pending.result()
            if final.is_file():
                return final
        return self._fetch(name)

    def open(self, name: str, opener: Callable[[Path], T]) -> T:
        """``opener(local copy of name)``, under a shared lock, so that no process on the node evicts the copy
        between its fetch and its opening (an open file stays readable after an eviction unlinks it)."""
        for _ in range(3):
            path = self.local(name)
            with self._locked(name, shared=True):
                if path.is_file():
                    return opener(path)
        raise UserError(
            f"rank {self.rank}: data shard {name} keeps being evicted from {self.folder} before it can "
            "be opened: data.cache_max_gb is too small for data.shuffle_window.",
            collective=False,
        )

    def will_need(self, names: list[str]) -> None:
        """Fetch ``names`` in the background, in this order; they are the ones this process keeps."""
        with self._mutex:
            self._wanted = set(names)
            for name in names:
                if name not in self._pending and not (self.folder / name).is_file():
                    self._pending[name] = self._pool.submit(self._fetch_quietly, name)

    def close(self) -> None:
        with self._mutex:
            for future in self._pending.values():
                future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------------------------------------ internals
    def _fetch_quietly(self, name: str) -> None:
        """A background fetch: its error is raised again by the read that needs the shard (``local``)."""
        try:
            self._fetch(name)
        except Exception as exc:  # noqa: BLE001 - seen again, with its message, by the reader
            log.warning("rank %d: background fetch of %s failed: %s", self.rank, join(self.url, name), exc)
        finally:
            with self._mutex:
                self._pending.pop(name, None)

    def _fetch(self, name: str) -> Path:
        final = self.folder / name
        with self._locked(name):
            if final.is_file():  # another rank of this node fetched it while this one waited
                return final
            self._make_room(self.sizes.get(name, 0), keep=name)
            started = time.monotonic()
            part = self.folder / f".part-{name}-{os.getpid()}-{threading.get_ident()}"
            try:
                digest = self._download(name, part)
                self._check(name, part, digest)
                with open(part, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(part, final)
            finally:
                part.unlink(missing_ok=True)
            self._record_verified(name, final)
            nbytes = final.stat().st_size
            record = {"file": name, "bytes": nbytes, "seconds": round(time.monotonic() - started, 3)}
            record |= {"pid": os.getpid(), "rank": self.rank, "time": time.time()}
            append_jsonl(self.folder / FETCHES, record)
            log.info("fetched %s (%.1f MB) into the node cache %s", join(self.url, name), nbytes / 1e6, self.folder)
            return final

    def _download(self, name: str, part: Path) -> str | None:
        """The shard into ``part``; its SHA-256 where the manifest has one and the listing its size (hashed as it
        arrives: Store.download_hashed), else None."""
        url, size, what = join(self.url, name), self.sizes.get(name), f"rank {self.rank}: data shard"
        for attempt in (1, 2):
            try:
                if self.expected.get(name) and size:
                    return self.store.download_hashed(url, str(part), size, what=what)
                self.store.download(url, str(part), what=what)
                return None
            except StoreError as exc:
                raise UserError(str(exc), collective=False) from None
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or attempt == 2:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise UserError(self._full_message(name), collective=False) from None
                    raise
                part.unlink(missing_ok=True)
                self._make_room(self.sizes.get(name, 0) or _CHUNK, keep=name, everything=True)

    def _found_good(self, name: str, final: Path) -> bool:
        """Whether a copy of ``name`` is in the cache and holds what the manifest says; a bad one is removed."""
        if not os.path.lexists(final):
            return False
        with self._locked(name):
            try:
                st = os.lstat(final)
            except FileNotFoundError:
                return False
            if stat.S_ISREG(st.st_mode):
                if self._matches_record(name, st):
                    self._verified.add(name)
                    return True
                expected = self.expected.get(name)
                digest = sha256_file(final) if expected else None
                if digest == expected:
                    self._record_verified(name, final, digest)
                    return True
            why = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"SHA-256 {digest}, not {expected}"
            log.warning("rank %d: the node cache's copy of %s is bad (%s): removed, downloaded again", self.rank,
                        name, why)  # fmt: skip
            final.unlink(missing_ok=True)
            return False

    def _matches_record(self, name: str, st: os.stat_result) -> bool:
        try:
            fd = os.open(self.folder / ".verified" / name, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as f:
                record = json.load(f)
        except (OSError, ValueError):
            return False
        return record == {"size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns,
                          "sha256": self.expected.get(name)}  # fmt: skip

    def _record_verified(self, name: str, final: Path, digest: str | None = None) -> None:
        """``final`` holds what the manifest says (checked by this process): the other processes need not hash it."""
        st = os.lstat(final)
        record = {"size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "sha256": self.expected.get(name)}
        write_json_atomic(self.folder / ".verified" / name, record, fsync=False)
        self._verified.add(name)

    def _check(self, name: str, part: Path, digest: str | None) -> None:
        """``part`` against the manifest's SHA-256 (``digest``: its hash taken during the download, else read)."""
        expected = self.expected.get(name)
        if not expected:
            return
        digest = digest or sha256_file(part)
        if digest != expected:
            raise UserError(
                f"rank {self.rank}: data shard {join(self.url, name)} failed its checksum after download: expected "
                f"SHA-256 {expected} (manifest.json), got {digest}. The object was altered or damaged "
                "after it was prepared; prepare the data again (or upload the shard again).",
                collective=False,
            )

    def _full_message(self, name: str) -> str:
        usage = shutil.disk_usage(self.folder)
        return (
            f"rank {self.rank}: the node cache {self.folder} (data.cache_dir) is full: data shard {name} "
            f"({self.sizes.get(name, 0) / 1e6:.1f} MB) does not fit in its {usage.free / 1e6:.1f} MB free, even "
            "with every shard this run does not need evicted; point data.cache_dir at a larger local disk, or lower "
            "data.shuffle_window (about two windows of shards must fit)."
        )

    def _make_room(self, incoming: int, *, keep: str, everything: bool = False) -> None:
        """Evict least recently used shards until ``incoming`` more bytes fit under the bound (with
        ``everything``: every shard that can go). A shard another process is fetching or opening (its lock
        held) stays; one that a reader has open stays readable (it holds the file) until closed."""
        if not self.max_bytes and not everything:
            return
        files = [p for p in self.folder.iterdir() if p.is_file() and not p.name.startswith(".") and p.name != FETCHES]
        stats = []
        for p in files:
            with contextlib.suppress(FileNotFoundError):
                stats.append((p.stat().st_mtime, p.stat().st_size, p))
        used = sum(size for _, size, _ in stats)
        with self._mutex:
            wanted = set(self._wanted)
        for _, size, path in sorted(stats):
            if not everything and used + incoming <= self.max_bytes:
                return
            if path.name in wanted or path.name == keep:
                continue
            if self._evict(path):
                used -= size

    def _evict(self, path: Path) -> bool:
        fd = self._lock_file(path.name)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            path.unlink(missing_ok=True)
            with self._mutex:
                self._verified.discard(path.name)
            log.info("evicted %s from the node cache", path.name)
            return True
        finally:
            os.close(fd)  # the flock goes with it

    def _lock_file(self, name: str) -> int:
        return os.open(self.folder / ".locks" / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    @contextlib.contextmanager
    def _locked(self, name: str, shared: bool = False) -> Iterator[None]:
        fd = self._lock_file(name)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _remove_dead_parts(self) -> None:
        """Downloads of processes that died (their pid gone) are removed; live ones are another rank's."""
        for part in self.folder.glob(".part-*"):
            try:
                pid = int(part.name.rsplit("-", 2)[-2])
                os.kill(pid, 0)
            except (ValueError, IndexError):
                part.unlink(missing_ok=True)
            except ProcessLookupError:
                part.unlink(missing_ok=True)
            except PermissionError:
                pass
