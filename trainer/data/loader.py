"""One rank's micro-batches from any map-style dataset, in the global sample order, prefetched in the background.

The global order (trainer/data/order.py: a pure function of (seed, epoch, position)) is consumed as one endless
stream; optimizer step k covers stream positions [p, p + global_batch), and micro-batch a on rank r takes block
(a * world_size + r) of it (``rank_slice``). So the samples of a step do not depend on the world size, and the
stream position is the only data state. Batches are fetched and collated by ``prefetch`` background threads, in
order, ahead of the step that needs them; a dataset whose items take I/O time (file reads, decoding that releases
the GIL) is then hidden behind the step. For a GPU, the threads also copy each batch into pinned (page-locked) host
memory, as torch's DataLoader does with ``pin_memory=True``: the copy to the device is then truly asynchronous, and a
pageable copy cannot hold the host back behind the device's queue.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from storage.ioretry import is_transient
from trainer.data.length_buckets import BucketedOrder, lengths_of, padding_fraction
from trainer.data.order import (
    PERMUTATION,
    Order,
    OrderSpec,
    PermutationOrder,
    WindowedOrder,
    rank_slice,
    shard_sizes_of,
)
from trainer.errors import UserError, first_line


def make_order(
    spec: OrderSpec,
    num_samples: int,
    seed: int,
    shard_sizes: Sequence[int] | None,
    lengths: np.ndarray | None = None,
) -> Order:
    """The run's global order: the base order, cut into length buckets when data.bucket_by_length asks."""
    base: Order
    if spec.name == PERMUTATION:
        base = PermutationOrder(num_samples, seed)
    else:
        base = WindowedOrder(shard_sizes if shard_sizes is not None else [num_samples], seed, spec.window)
    if not spec.bucket:
        return base
    assert lengths is not None
    return BucketedOrder(base, lengths, chunk=spec.bucket, window=spec.bucket_window, seed=seed)


def _each_tensor(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor of a (nested) batch; other values unchanged."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: _each_tensor(v, fn) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        moved = [_each_tensor(v, fn) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a (nested) batch on ``device``; other values unchanged."""
    return _each_tensor(batch, lambda t: t.to(device, non_blocking=True))


def pinned(batch: Any, device: torch.device) -> Any:
    """Every CPU tensor of a (nested) batch in pinned host memory for ``device`` (a CUDA device: a background thread
    first makes it its current device, else its pinned memory would create a context on GPU 0)."""
    torch.cuda.set_device(device)
    return _each_tensor(batch, lambda t: t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t)


def fetch(dataset: Any, ids: np.ndarray, collate: Callable[[list], Any], *, what: str, rank: int) -> Any:
    """The collated items ``ids`` of ``dataset``; a failing item or collate names the dataset, index and rank."""
    items = []
    for i in ids:
        try:
            items.append(dataset[int(i)])
        except UserError:
            raise
        except Exception as exc:  # the user's dataset: any error is theirs to see, with where it happened
            if is_transient(exc):
                raise  # a storage fault that outlived the dataset's retries: a crash (restarted), not bad input
            raise UserError(f"rank {rank}: {what}[{int(i)}] raised {first_line(exc)}.", collective=False) from None
    try:
        return collate(items)
    except Exception as exc:
        raise UserError(
            f"rank {rank}: collating {what} items {[int(i) for i in ids]} failed: {first_line(exc)}. Items of a "
            "batch must have the same structure, shapes and dtypes (or give the recipe a collate function).",
            collective=False,
        ) from None


class BatchLoader:
    """The micro-batches of one rank for consecutive optimizer steps from stream position ``start(position)``."""

    def __init__(
        self,
        dataset: Any,
        *,
        collate: Callable[[list], Any] | None,
        seed: int,
        order: OrderSpec,
        global_batch: int,
        micro_batch: int,
        world_size: int,
        rank: int,
        device: torch.device,
        prefetch: int,
        what: str = "train_data",
    ) -> None:
        self.dataset, self.collate = dataset, collate or default_collate
        self.seed, self.what = seed, what
        self.sizes = shard_sizes_of(dataset, what)
        # the items' lengths (a dataset of variable-length items): the padding measure, and data.bucket_by_length's
        self.lengths = lengths_of(dataset, what) if getattr(dataset, "lengths", None) is not None else None
        self.order: Order = self._make(order)
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.world_size, self.rank, self.device = world_size, rank, device
        self.accum = global_batch // (micro_batch * world_size)
        self.prefetch = prefetch
        self.pin = device.type == "cuda"
        self._pool = ThreadPoolExecutor(prefetch, thread_name_prefix="prefetch") if prefetch else None
        self._pending: deque[Future] = deque()
        self._next_key = (0, 0)  # (stream position of the step, micro-batch) of the next batch to fetch
        # A streaming dataset is told the shards ahead; one read in place (no cache) is not, nor pays for the hint.
        self._will_need = getattr(dataset, "will_need", None) if getattr(dataset, "streams", False) else None
        self._hinted: list[int] | None = None

    def ids(self, position: int, micro: int) -> np.ndarray:
        return rank_slice(
            self.order,
            position,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            world_size=self.world_size,
            rank=self.rank,
            micro=micro,
        )

    def use_order(self, spec: OrderSpec) -> None:
        """Consume the stream in ``spec``'s order from now on (a resumed run keeps the order it started with)."""
        if spec != self.order.spec:
            self._drop_pending()
            self.order = self._make(spec)

    def _make(self, spec: OrderSpec) -> Order:
        if spec.bucket and self.lengths is None:
            self.lengths = lengths_of(self.dataset, self.what)
        return make_order(spec, len(self.dataset), self.seed, self.sizes, self.lengths)

    def pad_fraction(self, position: int) -> float | None:
        """The share of padding in the step that starts at ``position`` (all ranks' micro-batches, each padded to
        its longest item), for a dataset with lengths; None without."""
        if self.lengths is None:
            return None
        return padding_fraction(self.lengths, self.order.take(position, self.global_batch), self.micro_batch)

    def start(self, position: int) -> None:
        """The next batch is micro-batch 0 of the step that starts at stream ``position``."""
        self._drop_pending()
        self._next_key = (position, 0)
        if self._pool is not None:
            for _ in range(self.prefetch):
                self._submit()

    def next(self) -> Any:
        """The next micro-batch (collated, on the device)."""
        if self._pool is None:
            batch = self._fetch_key(self._advance())
        else:
            future = self._pending.popleft()
            self._submit()
            batch = future.result()
        return to_device(batch, self.device)

    def batch_at(self, position: int, micro: int) -> Any:
        """One micro-batch fetched now, outside the stream (start-up checks)."""
        return to_device(self._fetch_key((position, micro)), self.device)

    def close(self) -> None:
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _advance(self) -> tuple[int, int]:
        key = position, micro = self._next_key
        if micro == 0 and self._will_need is not None:
            self._hint(position)
        self._next_key = (position, micro + 1) if micro + 1 < self.accum else (position + self.global_batch, 0)
        return key

    def _hint(self, position: int) -> None:
        """Tell a streaming dataset the shards of this step's window and the next one (fetched in the background
        while this window trains), when they change."""
        blocks = self.order.blocks_ahead(position, self.global_batch, windows_after=1)
        if blocks != self._hinted:
            self._hinted = blocks
            self._will_need(blocks)

    def _submit(self) -> None:
        assert self._pool is not None
        self._pending.append(self._pool.submit(self._fetch_key, self._advance()))

    def _fetch_key(self, key: tuple[int, int]) -> Any:
        batch = fetch(self.dataset, self.ids(*key), self.collate, what=self.what, rank=self.rank)
        return pinned(batch, self.device) if self.pin else batch

    def _drop_pending(self) -> None:
        for future in self._pending:
            future.cancel()
        for future in self._pending:  # a batch nobody will use: wait for it, its error is not this run's
            if not future.cancelled():
                with contextlib.suppress(Exception):
                    future.result()
        self._pending.clear()
