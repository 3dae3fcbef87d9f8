"""Length buckets (data.bucket_by_length): micro-batches of items of similar length cut the padding, while the order
stays a seeded permutation of each window, independent of the world size and resumable from the position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.data.length_buckets import BucketedOrder, lengths_of, pad_collate, padding_fraction
from trainer.data.loader import BatchLoader
from trainer.data.order import WINDOWED, OrderSpec, WindowedOrder, chosen_order, rank_slice
from trainer.errors import UserError

N, MICRO, GLOBAL = 960, 4, 32
LENGTHS = np.random.default_rng(0).integers(8, 512, size=N)  # a long-tailed mix of lengths
BUCKET = OrderSpec(WINDOWED, 64, bucket=MICRO, bucket_window=8 * GLOBAL)


class Texts(torch.utils.data.Dataset):
    lengths = LENGTHS

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((int(LENGTHS[i]),), i)


def order(bucketed: bool, seed: int = 5):
    base = WindowedOrder([N], seed, 64)
    return BucketedOrder(base, LENGTHS, chunk=MICRO, window=8 * GLOBAL, seed=seed) if bucketed else base


def test_buckets_cut_the_padding():
    plain = padding_fraction(LENGTHS, order(False).take(0, 8 * GLOBAL), MICRO)
    bucketed = padding_fraction(LENGTHS, order(True).take(0, 8 * GLOBAL), MICRO)
    assert plain > 0.3 and bucketed < 0.05, (plain, bucketed)


def test_bucketed_order_is_a_deterministic_permutation_of_each_window():
    a, b = order(True), order(True)
    window = a.take(0, 8 * GLOBAL)
    assert np.array_equal(window, b.take(0, 8 * GLOBAL))
    assert sorted(window.tolist()) == sorted(order(False).take(0, 8 * GLOBAL).tolist())  # the same samples
    assert not np.array_equal(window, order(True, seed=6).take(0, 8 * GLOBAL))
    # a window regroups a stretch of the base stream: 4 epochs (15 windows) hold every sample 4 times
    assert np.array_equal(np.bincount(a.take(0, 4 * N), minlength=N), np.full(N, 4))


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_each_micro_batch_is_one_bucket_whatever_the_world_size(world):
    o = order(True)
    for position in range(0, 3 * N, GLOBAL):
        accum = GLOBAL // (MICRO * world)
        ids = [
            rank_slice(o, position, global_batch=GLOBAL, micro_batch=MICRO, world_size=world, rank=r, micro=m)
            for m in range(accum)
            for r in range(world)
        ]
        assert np.array_equal(np.sort(np.concatenate(ids)), np.sort(o.take(position, GLOBAL)))
        chunks = {tuple(o.take(position + i * MICRO, MICRO)) for i in range(GLOBAL // MICRO)}
        assert {tuple(x) for x in ids} == chunks  # a micro-batch is one aligned chunk, on any rank


def test_the_loader_pads_within_a_bucket_and_reports_it():
    def loader(spec):
        return BatchLoader(Texts(), collate=pad_collate(pad=-1), seed=5, order=spec, global_batch=GLOBAL,
                           micro_batch=MICRO, world_size=2, rank=1, device=torch.device("cpu"), prefetch=1)  # fmt: skip

    plain, bucketed = loader(OrderSpec(WINDOWED, 64)), loader(BUCKET)
    try:
        assert plain.pad_fraction(0) > 0.3 and bucketed.pad_fraction(0) < 0.1
        bucketed.start(0)
        batch = bucketed.next()
        ids = batch[:, 0]
        assert batch.shape == (MICRO, int(LENGTHS[ids].max()))  # padded to its own longest item
        assert ((batch == -1).sum(1) == batch.shape[1] - torch.as_tensor(LENGTHS[ids])).all()
    finally:
        plain.close()
        bucketed.close()


def test_lengths_are_checked_and_the_bucketing_is_kept_on_resume():
    with pytest.raises(UserError, match="data.bucket_by_length needs train_data.lengths"):
        lengths_of([1, 2], "train_data")

    class Wrong(Texts):
        lengths = LENGTHS[:5]

    with pytest.raises(UserError, match="must hold one non-negative length per item: 960 items, got 5"):
        lengths_of(Wrong(), "train_data")
    recorded = BUCKET.as_dict()
    assert chosen_order("auto", 64, recorded, True, MICRO, 8 * GLOBAL) == BUCKET
    with pytest.raises(UserError, match="bucketed by length .4 per micro-batch"):
        chosen_order("auto", 64, recorded, True, 0, 0)
