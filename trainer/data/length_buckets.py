"""Length buckets for map-style datasets of variable-length items (``data.bucket_by_length``).

The stream of the base order (trainer/data/order.py) is cut into windows of ``window`` samples (a whole number of
global batches); within each, samples are sorted by length (ties by stream position), cut into chunks of one
micro-batch each, and the chunks shuffled with (seed, window). A micro-batch is then one chunk of similar lengths,
padded only to its own longest item, while the stream stays a pure function of (seed, position): independent of
the world size (a micro-batch is one aligned block of the stream whichever rank takes it) and resumable from the
position alone. The dataset gives its items' lengths as ``lengths`` (a sequence, in index order).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trainer.data.order import Order, OrderSpec, stitched
from trainer.errors import UserError


def lengths_of(dataset: object, what: str) -> np.ndarray:
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        raise UserError(
            f"data.bucket_by_length needs {what}.lengths: the length of every item, in index order (a list or "
            "array of len(dataset) integers); the dataset has no `lengths` attribute."
        )
    out = np.asarray(lengths() if callable(lengths) else lengths, dtype=np.int64)
    if out.shape != (len(dataset),) or (out < 0).any():  # type: ignore[arg-type]
        raise UserError(
            f"{what}.lengths must hold one non-negative length per item: {len(dataset)} items, got "  # type: ignore[arg-type]
            f"{out.shape[0] if out.ndim == 1 else out.shape} lengths."
        )
    return out


class BucketedOrder:
    """``base``'s stream regrouped so that each aligned block of ``chunk`` samples holds items of similar length."""

    def __init__(self, base: Order, lengths: np.ndarray, *, chunk: int, window: int, seed: int) -> None:
        if window % chunk:
            raise ValueError(f"bucket window {window} is not a multiple of the micro-batch {chunk}")
        self.base, self.lengths, self.chunk, self.window, self.seed = base, lengths, chunk, window, seed
        self.spec = OrderSpec(base.spec.name, base.spec.window, bucket=chunk, bucket_window=window)
        self._cache: tuple[int, np.ndarray] | None = None

    def regrouped(self, k: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != k:
            ids = self.base.take(k * self.window, self.window)
            by_length = ids[np.argsort(self.lengths[ids], kind="stable")]
            chunks = by_length.reshape(-1, self.chunk)
            perm = np.random.Generator(np.random.PCG64([self.seed, k, 2])).permutation(len(chunks))
            self._cache = (k, chunks[perm].reshape(-1))
        return self._cache[1]

    def take(self, position: int, count: int) -> np.ndarray:
        return stitched(position, count, self.window, self.regrouped)

    def blocks_ahead(self, position: int, count: int, windows_after: int = 0) -> list[int]:
        k = position // self.window
        return self.base.blocks_ahead(k * self.window, self.window * (1 + windows_after))


def padding_fraction(lengths: np.ndarray, ids: np.ndarray, chunk: int) -> float:
    """The share of padding when the items ``ids`` are batched ``chunk`` at a time, each batch padded to its longest."""
    lens = lengths[ids].reshape(-1, chunk)
    padded = lens.max(axis=1, keepdims=True) * chunk
    return float(1.0 - lens.sum() / max(1, padded.sum()))


def pad_collate(pad: int = 0, key: str | None = None):
    """A collate function for items that are 1-D tensors (or dicts whose ``key`` is one): stacked, each padded at
    the end with ``pad`` to the batch's longest; dict items get a boolean ``attention_mask`` of the real tokens."""

    def collate(items: Sequence) -> object:
        seqs = [torch.as_tensor(item[key] if key else item) for item in items]
        longest = max(len(s) for s in seqs)
        out = torch.full((len(seqs), longest), pad, dtype=seqs[0].dtype)
        mask = torch.zeros((len(seqs), longest), dtype=torch.bool)
        for i, s in enumerate(seqs):
            out[i, : len(s)] = s
            mask[i, : len(s)] = True
        if key is None:
            return out
        rest = {k: torch.utils.data.default_collate([item[k] for item in items]) for k in items[0] if k != key}
        return {key: out, "attention_mask": mask, **rest}

    return collate
