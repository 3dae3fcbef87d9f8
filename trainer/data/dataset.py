"""Reading prepared token shards lazily.

A *sample* is a window of ``seq_len + 1`` consecutive tokens inside one shard (documents are packed back to back,
separated by EOS, so windows cross document boundaries: sequence packing). Windows do not overlap; a shard's
tail shorter than a window is left out. The order in which training visits them is trainer/data/order.py's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import threading
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from storage.ioretry import RetryPolicy, is_transient, retry
from storage.objstore import join
from trainer.data.node_cache import NodeCache
from trainer.errors import UserError

log = logging.getLogger(__name__)
NO_RETRY = RetryPolicy(0, 1.0, "data.read_retries")


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / "manifest.json"
    if not Path(folder).is_dir():
        raise UserError(f"data path {folder} does not exist (set data.path, or data.source to prepare it).")
    try:
        manifest = json.loads(path.read_text())
        manifest["splits"]["train"], manifest["splits"]["val"], manifest["vocab_size"]  # noqa: B018
    except FileNotFoundError:
        raise UserError(
            f"data path {folder} has no manifest.json: it is not a prepared dataset "
            "(prepare one with `python -m trainer.data prepare --source DIR --out OUT`)."
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"data manifest {path} is malformed ({type(exc).__name__}: {exc}).") from None
    return manifest


def reprepare_hint(folder: Path) -> str:
    """What to do about a damaged prepared dataset."""
    return (
        f"prepare the data again: delete {folder} (a data.source dataset in the cache is prepared again on the "
        "next start; for data.path re-run `python -m trainer.data prepare`)"
    )


class TokenShards:
    """The windows of one split, read lazily: a shard file is opened on first use, and only the rows asked for
    are read. With ``check_range`` every window read is checked against the manifest's vocabulary (one max per
    window), so a damaged token stops this rank with the shard and offset named instead of an IndexError in the
    model; a dataset whose shards were verified by checksum at start-up does not need it.

    A read that fails with a transient storage error (storage/ioretry.py) is retried under ``retry``, the shard
    reopened each time; when the retries are exhausted the error propagates (a crash, restarted by the launcher).
    ``before_read`` is called with the shard's path before each read (fault injection in tests).

    A shard in the node cache (``cache``) is memory-mapped once open: a window is then a slice of the mapping,
    without a system call or the lock. Shards read in place (``data.path``, often a parallel file system) are read
    with ``pread``, where an I/O error is an exception that can be retried rather than a SIGBUS."""

    def __init__(
        self,
        folder: Path,
        manifest: dict,
        split: str,
        seq_len: int,
        *,
        rank: int = 0,
        check_range: bool = True,
        retry: RetryPolicy = NO_RETRY,
        before_read: Callable[[Path], None] | None = None,
        cache: NodeCache | None = None,
    ) -> None:
        self.folder = Path(folder) if cache is None else cache.url  # where the shards are, for messages
        self.window = seq_len + 1
        self.shards = manifest["splits"][split]
        self.cache = cache
        # what messages name: the shard's path, or its URL (read from the node cache)
        self.paths = [self.folder / s["file"] if cache is None else join(cache.url, s["file"]) for s in self.shards]
        self.split = split
        self.vocab_size = int(manifest["vocab_size"])
        self.eos = int(manifest.get("eos_id", manifest.get("eos", 256)))  # ends every document of the windows
        self.dtype = np.dtype(manifest.get("dtype", "uint16"))
        self.rank = rank
        self.check_range = check_range
        self.retry, self.before_read = retry, before_read
        per_shard = np.array([s["tokens"] // self.window for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(per_shard)])
        self._first = self.starts.tolist()  # the same, for bisect: a window's lookup without numpy's call cost
        self._files: dict[int, h5py.Dataset] = {}
        self._raw: dict[int, _Raw | None] = {}  # per open shard: where its tokens lie in the file, or None
        self._mapped: dict[int, np.ndarray] = {}  # per open cached shard: its tokens, memory-mapped
        self._lock = threading.Lock()  # prefetch threads open shards lazily
        if len(self) == 0:
            raise UserError(
                f"data split {split!r} in {folder} has no window of {self.window} tokens "
                f"(model.seq_len={seq_len} is longer than every shard)."
            )

    def __len__(self) -> int:
        return self._first[-1]

    @property
    def shard_sizes(self) -> list[int]:
        """Windows per shard, in index order: the blocks the windowed order shuffles (trainer/data/order.py)."""
        return np.diff(self.starts).tolist()

    @property
    def streams(self) -> bool:
        """Whether shards come through the node cache (the loader then says which it will need)."""
        return self.cache is not None

    def will_need(self, shards: list[int]) -> None:
        """The shards the next stretch of training reads (trainer/data/order.py, ``blocks_ahead``): fetched ahead
        into the node cache; open shards outside them are closed, so that their copies can be evicted."""
        if self.cache is None:
            return
        self.cache.will_need([self.shards[i]["file"] for i in shards])
        keep = set(shards)
        with self._lock:
            for i in [i for i in self._files if i not in keep]:
                self._forget(i).file.close()

    def verify(self) -> None:
        """Open every shard and check its length and dtype against the manifest (cheap: no token is read)."""
        for i in range(len(self.shards)):
            self._check_shape(i, self._dataset(i))

    def _check_shape(self, i: int, ds: h5py.Dataset) -> None:
        shard = self.shards[i]
        if ds.shape != (shard["tokens"],) or ds.dtype != self.dtype:
            raise UserError(
                f"rank {self.rank}: data shard {self.paths[i]} holds {ds.dtype}{list(ds.shape)}, "
                f"but the manifest says {self.dtype}[{shard['tokens']}]: the shard or manifest is corrupt; "
                f"{reprepare_hint(self.folder)}."
            )

    def sample(self, index: int) -> np.ndarray:
        shard = bisect_right(self._first, index) - 1
        offset = (index - self._first[shard]) * self.window
        path = self.paths[shard]
        tokens = self._mapped.get(shard)  # a reference: a concurrent close drops the dict's, not this one
        if tokens is not None and self.before_read is None:
            window = tokens[offset : offset + self.window]
        else:
            try:
                window = retry(lambda: self._read(shard, offset), self.retry, what="data read of", path=path, log=log)
            except OSError as exc:
                if is_transient(exc):
                    raise  # it outlived the retries: a crash (restarted in the job), not bad data
                raise UserError(f"rank {self.rank}: data shard {path} cannot be read: {exc}.") from None
        if self.check_range and len(window) and int(window.max()) >= self.vocab_size:
            at = int(np.argmax(window >= self.vocab_size))
            raise UserError(
                f"rank {self.rank}: data shard {path} holds token {window[at]} "
                f"at token offset {offset + at}, outside the dataset's vocabulary of {self.vocab_size} "
                f"(manifest.json): the shard is corrupt; {reprepare_hint(self.folder)}. data.verify=checksum finds "
                "such damage at start-up."
            )
        return window.astype(np.int64)

    def __getitem__(self, index: int) -> np.ndarray:
        """Window ``index`` (``seq_len + 1`` int64 tokens): a map-style dataset for the batch loader."""
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range [0, {len(self)})")
        return self.sample(index)

    def close(self) -> None:
        """Close every open shard; a later read opens its shard again. Under the lock: a descriptor closed while a
        prefetch thread reads through it could be reused by another file and read from."""
        with self._lock:
            for ds in self._files.values():
                ds.file.close()
            self._files.clear()
            self._raw.clear()
            self._mapped.clear()

    def _read(self, shard: int, offset: int) -> np.ndarray:
        """One attempt, under the lock (h5py runs one call at a time anyway). After a transient error the shard's
        handle is closed before any other thread can read through it, and the next attempt opens it afresh: HDF5
        shares one open file among all handles of a file, and after a failed read its sieve buffer can hold
        another region's bytes (a read through the old handle then returns wrong tokens without an error)."""
        with self._lock:
            ds = self._open(shard)
            try:
                if self.before_read is not None:
                    self.before_read(self.paths[shard])
                tokens = self._mapped.get(shard)
                if tokens is not None:
                    return tokens[offset : offset + self.window]
                raw = self._raw[shard]
                if raw is not None and offset + self.window <= raw.length:
                    return raw.read(offset, self.window)
                return ds[offset : offset + self.window]
            except OSError as exc:
                if is_transient(exc):
                    self._forget(shard)
                    with contextlib.suppress(Exception):  # its file descriptor may be the broken part
                        ds.file.close()
                raise

    def _forget(self, shard: int) -> h5py.Dataset:
        """Drop an open shard (under the lock); its mapping goes when the last window sliced from it is copied."""
        self._raw.pop(shard, None)
        self._mapped.pop(shard, None)
        return self._files.pop(shard)

    def _dataset(self, shard: int) -> h5py.Dataset:
        with self._lock:
            return self._open(shard)

    def _open(self, shard: int) -> h5py.Dataset:
        ds = self._files.get(shard)
        if ds is None:
            path = self.paths[shard]
            try:
                if self.cache is None:
                    f = h5py.File(path, "r")
                else:
                    f = self.cache.open(self.shards[shard]["file"], lambda local: h5py.File(local, "r"))
                ds = f["tokens"]
            except (OSError, KeyError) as exc:
                if is_transient(exc):
                    raise  # retried by the caller
                raise UserError(
                    f"rank {self.rank}: data shard {path} is not a readable HDF5 token file ({exc}); "
                    f"{reprepare_hint(self.folder)}."
                ) from None
            if self.cache is not None:  # a remote dataset's shards are checked as they arrive, not at start
                try:
                    self._check_shape(shard, ds)
                except UserError:
                    ds.file.close()
                    raise
            self._files[shard] = ds
            raw = self._raw[shard] = _Raw.of(ds)
            if self.cache is not None and raw is not None:
                tokens = raw.mapped()
                if tokens is not None:
                    self._mapped[shard] = tokens
        return ds


@dataclass(frozen=True)
class _Raw:
    """Where a contiguous, unfiltered token dataset lies in its file, to read a window with one ``pread`` on the
    descriptor HDF5 itself holds: several times faster than h5py's slicing, and the prefetch threads read one window per
    sample (docs/measurements/overhead.md, "token windows by pread"). The same descriptor: a broken handle fails the
    same way for both paths, and closing the h5py file closes it. None for any other layout (chunked, compressed,
    another file driver): h5py reads those."""

    fd: int
    start: int  # byte offset of token 0
    length: int  # tokens in the dataset
    dtype: np.dtype

    @classmethod
    def of(cls, ds: h5py.Dataset) -> _Raw | None:
        start = ds.id.get_offset()
        plist = ds.id.get_create_plist()
        if (
            start is None
            or ds.chunks is not None
            or plist.get_nfilters()
            or plist.get_external_count()
            or ds.file.driver != "sec2"
            or ds.ndim != 1
        ):
            return None
        return cls(ds.file.id.get_vfd_handle(), start, int(ds.shape[0]), ds.dtype)

    def mapped(self) -> np.ndarray | None:
        """The tokens as an array over a read-only mapping of the file, or None when the file is shorter than they
        are or cannot be mapped (the ``pread`` path then reads it, and names a short read). Only for a file that is
        never rewritten in place, as the node cache's are (written under another name, renamed, unlinked when
        evicted): a mapped file that shrank would end the process with SIGBUS. The mapping holds its own
        descriptor: closing the h5py file leaves it."""
        end = self.start + self.length * self.dtype.itemsize
        try:
            if os.fstat(self.fd).st_size < end:
                return None
            mm = mmap.mmap(self.fd, end, access=mmap.ACCESS_READ)  # unmapped when the array is freed
        except (OSError, ValueError):
            return None
        return np.frombuffer(mm, dtype=self.dtype, count=self.length, offset=self.start)

    def read(self, offset: int, count: int) -> np.ndarray:
        nbytes = count * self.dtype.itemsize
        data = os.pread(self.fd, nbytes, self.start + offset * self.dtype.itemsize)
        if len(data) != nbytes:  # the file shrank under the open handle: reopened on retry, then named
            raise OSError(errno.EIO, f"short read: {len(data)} of {nbytes} bytes at token {offset}")
        return np.frombuffer(data, dtype=self.dtype)
