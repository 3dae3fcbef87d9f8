"""The global sample order: an endless stream of sample indices, a pure function of (seed, epoch, position).

Two orders, recorded in every checkpoint so a run keeps its own (``OrderSpec``):

- ``windowed`` (the default for new runs): each epoch shuffles the dataset's shards (blocks of consecutive samples),
  groups the shuffled shards into windows of ``window`` shards, and visits each window's samples in a pseudo-random
  permutation computed index by index (a Feistel network), so nothing proportional to the number of samples is
  ever held. Memory: two integers per shard, and the last two chunks of ``CHUNK`` permuted offsets. A stretch of
  the stream touches only the shards of the windows it crosses, so a streaming node needs a window of the dataset
  at a time. A dataset without shards is one block: the whole epoch is one pseudo-random permutation, still with
  constant memory.
- ``permutation``: a full ``numpy`` permutation of every sample per epoch (8 bytes per sample on every rank), the
  order of runs started before the windowed one existed.

A step covers stream positions [p, p + global_batch) whatever the world size; micro-step a on rank r takes block
(a * world_size + r) of it (``rank_slice``), so the samples of a step do not depend on the world size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from runconfig import RunConfig
from trainer.errors import UserError

WINDOWED, PERMUTATION = "windowed", "permutation"
CHUNK = 1024  # window offsets the windowed order permutes at once (8 KB of int64 each, two chunks kept)
ORDERS = (WINDOWED, PERMUTATION)
_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class OrderSpec:
    """Which order a run uses; ``window`` (shards per shuffle window) only matters for the windowed one; with
    ``bucket`` (the micro-batch) the stream is regrouped by length in windows of ``bucket_window`` samples
    (trainer/data/length_buckets.py)."""

    name: str
    window: int = 0
    bucket: int = 0
    bucket_window: int = 0

    def as_dict(self) -> dict:
        out = {"name": self.name, "window": self.window}
        return out | ({"bucket": self.bucket, "bucket_window": self.bucket_window} if self.bucket else {})

    @classmethod
    def of(cls, record: dict | None) -> OrderSpec:
        """The order a checkpoint records; a checkpoint that records none was written with the permutation."""
        if not record:
            return cls(PERMUTATION)
        return cls(
            str(record["name"]),
            int(record.get("window", 0)),
            int(record.get("bucket", 0)),
            int(record.get("bucket_window", 0)),
        )

    def describe(self) -> str:
        text = f"windowed (window of {self.window} shards)" if self.name == WINDOWED else self.name
        if self.bucket:
            text += f", bucketed by length ({self.bucket} per micro-batch, windows of {self.bucket_window} samples)"
        return text


class Order(Protocol):
    spec: OrderSpec

    def take(self, position: int, count: int) -> np.ndarray: ...

    def blocks_ahead(self, position: int, count: int, windows_after: int = 0) -> list[int]: ...


def chosen_order(
    configured: str, window: int, recorded: dict | None, resumed: bool, bucket: int = 0, bucket_window: int = 0
) -> OrderSpec:
    """The order a launch uses: data.order for a new run ('auto': windowed), bucketed by length with ``bucket``
    (the micro-batch); a resumed run keeps its checkpoint's, and a config naming another is refused (the stream
    would repeat some samples and skip others)."""
    base = OrderSpec(WINDOWED, window) if configured in ("auto", WINDOWED) else OrderSpec(PERMUTATION)
    fresh = OrderSpec(base.name, base.window, bucket, bucket_window if bucket else 0)
    if not resumed:
        return fresh
    kept = OrderSpec.of(recorded)
    if kept == fresh or (
        configured == "auto" and (kept.bucket, kept.bucket_window) == (fresh.bucket, fresh.bucket_window)
    ):
        return kept
    raise UserError(
        f"data.order={configured} (data.shuffle_window={window}"
        + (f", bucketed by length, {bucket} per micro-batch" if bucket else "")
        + f") is not the order this run's checkpoint was trained in: {kept.describe()}. Changing the order mid-run "
        "would repeat some samples and skip others; set data.order=auto (and data.bucket_by_length, "
        "train.micro_batch_size as they were) to keep the run's own order, or start a new run."
    )


def shard_sizes_of(dataset: object, what: str) -> list[int] | None:
    """A dataset's ``shard_sizes`` (samples per shard, in index order), checked against its length; None if it has
    none. Items [0, s0) are shard 0, [s0, s0 + s1) shard 1, and so on."""
    sizes = getattr(dataset, "shard_sizes", None)
    if sizes is None:
        return None
    sizes = [int(s) for s in (sizes() if callable(sizes) else sizes)]
    if any(s < 0 for s in sizes) or sum(sizes) != len(dataset):  # type: ignore[arg-type]
        raise UserError(
            f"{what}.shard_sizes must be non-negative sample counts summing to len({what}) = "
            f"{len(dataset)}; they sum to {sum(sizes)} (min {min(sizes, default=0)})."  # type: ignore[arg-type]
        )
    return sizes


class PermutationOrder:
    """Epoch e is ``numpy``'s permutation of range(num_samples) seeded by (seed, e)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples, self.seed = num_samples, seed
        self.spec = OrderSpec(PERMUTATION)
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._cache.get(epoch)
        if perm is None:
            perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.num_samples)
            self._cache = {epoch: perm}  # keep only the current epoch
        return perm

    def take(self, position: int, count: int) -> np.ndarray:
        """Sample indices at stream positions [position, position + count)."""
        return stitched(position, count, self.num_samples, self.permutation)

    def blocks_ahead(self, position: int, count: int, windows_after: int = 0) -> list[int]:
        return []  # every sample anywhere: nothing to stream ahead


def stitched(position: int, count: int, period: int, block: Callable[[int], np.ndarray]) -> np.ndarray:
    """Stream positions [position, position + count) of a stream made of consecutive blocks of ``period`` indices,
    block k being ``block(k)``."""
    out = np.empty(count, dtype=np.int64)
    done = 0
    while done < count:
        k, offset = divmod(position + done, period)
        n = min(count - done, period - offset)
        out[done : done + n] = block(k)[offset : offset + n]
        done += n
    return out


class WindowedOrder:
    """Shards shuffled per epoch, then samples shuffled within windows of ``window`` consecutive shuffled shards."""

    def __init__(self, shard_sizes: Sequence[int], seed: int, window: int) -> None:
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        if sizes.ndim != 1 or len(sizes) == 0 or sizes.sum() <= 0:
            raise ValueError(f"a windowed order needs at least one non-empty shard, got sizes {list(sizes)[:8]}")
        self.sizes, self.seed = sizes, seed
        self.window = max(1, int(window)) if len(sizes) > 1 else 1
        self.spec = OrderSpec(WINDOWED, int(window))
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # first sample of each shard
        self.num_samples = int(self.starts[-1])
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._chunks: tuple[tuple[tuple[int, int, int], np.ndarray], ...] = ()  # the last two computed, newest first

    def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shards in this epoch's order, the epoch offset at which each one's samples begin, plus the end)."""
        got = self._epochs.get(epoch)
        if got is None:
            perm = np.random.Generator(np.random.PCG64([self.seed, epoch, 1])).permutation(len(self.sizes))
            got = perm, np.concatenate([[0], np.cumsum(self.sizes[perm])])
            self._epochs = {e: v for e, v in self._epochs.items() if e >= epoch - 1} | {epoch: got}
        return got

    def take(self, position: int, count: int) -> np.ndarray:
        """Sample indices at stream positions [position, position + count)."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            epoch, offset = divmod(position + done, self.num_samples)
            perm, cum = self.epoch(epoch)
            w = int(np.searchsorted(cum, offset, side="right") - 1) // self.window
            lo, hi = w * self.window, min((w + 1) * self.window, len(perm))
            begin, end = int(cum[lo]), int(cum[hi])
            n = min(count - done, end - offset)
            shuffled = self._shuffled(epoch, w, end - begin, offset - begin, n)
            # the shuffled window offset -> which of the window's shards, and where in it
            seg = cum[lo : hi + 1] - begin
            at = np.searchsorted(seg, shuffled, side="right") - 1
            out[done : done + n] = self.starts[perm[lo + at]] + (shuffled - seg[at])
            done += n
        return out

    def _shuffled(self, epoch: int, w: int, size: int, first: int, n: int) -> np.ndarray:
        """The window's permutation (``size`` samples) at its offsets [first, first + n), computed ``CHUNK`` offsets
        at a time: one Feistel call costs about the same for 64 offsets as for a chunk, and consecutive takes
        (a step's micro-batches, the next step) fall in the chunk computed last."""
        out = np.empty(n, dtype=np.int64)
        done = 0
        while done < n:
            c = (first + done) // CHUNK
            key = (epoch, w, c)
            chunks = self._chunks  # read once: prefetch threads take concurrently and replace the tuple
            values = next((v for k, v in chunks if k == key), None)
            if values is None:
                lo = c * CHUNK
                local = np.arange(lo, min(lo + CHUNK, size), dtype=np.uint64)
                values = feistel(local, size, (self.seed, epoch, w)).astype(np.int64)
                self._chunks = ((key, values), *chunks[:1])
            at = first + done - c * CHUNK
            m = min(n - done, len(values) - at)
            out[done : done + m] = values[at : at + m]
            done += m
        return out

    def blocks_ahead(self, position: int, count: int, windows_after: int = 0) -> list[int]:
        """The shards read at stream positions [position, position + count), then those of the next
        ``windows_after`` windows, in the order they are first needed (whole windows: a window's samples come in
        any order)."""
        out: list[int] = []
        seen: set[int] = set()
        pos, end, extra = position, position + count, windows_after
        while pos < end or extra > 0:
            extra -= pos >= end
            epoch, offset = divmod(pos, self.num_samples)
            perm, cum = self.epoch(epoch)
            w = int(np.searchsorted(cum, offset, side="right") - 1) // self.window
            lo, hi = w * self.window, min((w + 1) * self.window, len(perm))
            for shard in perm[lo:hi].tolist():
                if shard not in seen and self.sizes[shard]:
                    seen.add(shard)
                    out.append(shard)
            pos = epoch * self.num_samples + int(cum[hi])
        return out


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (mod 2**64): the round keys."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _round_keys(key: tuple[int, ...], rounds: int) -> list[np.uint64]:
    h = 0x9E3779B97F4A7C15
    for part in key:
        h = _mix_int(h ^ (int(part) & _M64))
    return [np.uint64(_mix_int(h ^ ((r + 1) * 0x632BE59BD9B4E019 & _M64))) for r in range(rounds)]


def feistel(index: np.ndarray, n: int, key: tuple[int, ...], rounds: int = 6) -> np.ndarray:
    """A pseudo-random permutation of range(n) applied to ``index`` (uint64 values < n): a balanced Feistel
    network on the smallest even number of bits covering n, cycle-walked back into range. Pure integer
    arithmetic, so the same on every machine."""
    if n <= 1:
        return index.copy()
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    keys = _round_keys(key, rounds)
    out = index.astype(np.uint64)
    todo = np.ones(len(out), dtype=bool)
    while todo.any():
        x = out[todo]
        left, right = x >> shift, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        x = (left << shift) | right
        out[todo] = x
        todo[todo] = x >= np.uint64(n)
    return out


def rank_slice(
    order: Order, position: int, *, global_batch: int, micro_batch: int, world_size: int, rank: int, micro: int
) -> np.ndarray:
    """Indices for one rank's micro-batch ``micro`` of the optimizer step that starts at ``position``.

    The step covers positions [position, position + global_batch) whatever the world size; micro-step a on rank r
    takes the block (a * world_size + r) of size micro_batch.
    """
    assert global_batch % (micro_batch * world_size) == 0
    block = micro * world_size + rank
    return order.take(position + block * micro_batch, micro_batch)


def bucketing(cfg: RunConfig) -> tuple[int, int]:
    """(micro-batch, window in samples) of data.bucket_by_length, or (0, 0)."""
    if not cfg.data.bucket_by_length:
        return 0, 0
    return cfg.train.micro_batch_size, cfg.data.bucket_window * cfg.train.global_batch_size
