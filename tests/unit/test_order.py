"""The global sample order (trainer/data/order.py): both orders are a seeded permutation per epoch, split over ranks
without depending on the world size, and resumable from the position alone; the windowed one reads a window of
shards at a time and holds nothing proportional to the number of samples."""

from __future__ import annotations

import json
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from trainer.checkpoint.state import TrainState
from trainer.data.loader import make_order
from trainer.data.order import (
    CHUNK,
    PERMUTATION,
    WINDOWED,
    OrderSpec,
    PermutationOrder,
    WindowedOrder,
    chosen_order,
    feistel,
    rank_slice,
    shard_sizes_of,
)
from trainer.errors import UserError

SIZES = [100, 50, 0, 200, 7, 300, 143]  # 800 samples, an empty shard among them
ORDERS = {
    "permutation": lambda seed=3: PermutationOrder(sum(SIZES), seed),
    "windowed": lambda seed=3: WindowedOrder(SIZES, seed, window=2),
    "one-block": lambda seed=3: WindowedOrder([sum(SIZES)], seed, window=64),
}


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_feistel_is_a_permutation(n):
    out = feistel(np.arange(n, dtype=np.uint64), n, (1, 2, 3))
    assert sorted(out.tolist()) == list(range(n))
    assert n < 64 or not np.array_equal(out, np.arange(n))
    assert n < 64 or not np.array_equal(out, feistel(np.arange(n, dtype=np.uint64), n, (1, 2, 4)))


@pytest.mark.parametrize("kind", ORDERS)
def test_each_epoch_is_a_seeded_permutation(kind):
    order, n = ORDERS[kind](), sum(SIZES)
    e0, e1 = order.take(0, n), order.take(n, n)
    assert sorted(e0.tolist()) == list(range(n)) and sorted(e1.tolist()) == list(range(n))
    assert not np.array_equal(e0, e1)
    assert np.array_equal(ORDERS[kind]().take(0, n), e0)
    assert not np.array_equal(ORDERS[kind](seed=4).take(0, n), e0)
    assert np.array_equal(order.take(n - 10, 30), np.concatenate([e0[-10:], e1[:20]]))  # across the boundary
    assert all(np.array_equal(order.take(p, 7), e0[p : p + 7]) for p in range(0, n - 7, 37))  # any position


def test_the_windowed_order_is_pinned():
    """The order is a checkpointed run's contract: a release that changed it would break every resume."""
    # window 0 is shards 2 (empty) and 4 (samples 350..356), window 1 shards 0 and 3
    assert WindowedOrder(SIZES, 1234, window=2).take(0, 8).tolist() == [356, 353, 355, 354, 352, 351, 350, 194]
    assert WindowedOrder([10**9], 1234, window=64).take(10**8, 4).tolist() == [
        626396, 894400309, 532032145, 554142781
    ]  # fmt: skip


def test_takes_are_the_permutation_of_each_offset_whatever_the_chunks():
    """The windowed order permutes a chunk of offsets at once and keeps the last ones: any take, from a fresh order
    or one that computed other chunks before, from several threads at once, is the element-wise Feistel value."""
    n = 3 * CHUNK + 77  # one block: the window is the whole epoch
    reference = feistel(np.arange(n, dtype=np.uint64), n, (9, 0, 0)).astype(np.int64)
    reused = WindowedOrder([n], 9, window=64)
    for position, count in [(0, 5), (CHUNK - 3, 7), (CHUNK - 3, 2 * CHUNK + 10), (n - 40, 40), (17, n - 17), (5, 5)]:
        want = reference[position : position + count]
        assert np.array_equal(WindowedOrder([n], 9, window=64).take(position, count), want), (position, count)
        assert np.array_equal(reused.take(position, count), want), (position, count)
    shared = WindowedOrder([n], 9, window=64)
    starts = list(range(0, n - 64, 61)) * 3
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: shared.take(p, 64), starts))
    assert all(np.array_equal(g, reference[p : p + 64]) for p, g in zip(starts, got, strict=True))


def test_the_permutation_is_the_order_of_earlier_runs():
    """Runs checkpointed before the windowed order existed drew numpy's permutation seeded by (seed, epoch)."""
    order = PermutationOrder(800, 7)
    for epoch in range(2):
        legacy = np.random.Generator(np.random.PCG64([7, epoch])).permutation(800)
        assert np.array_equal(order.take(800 * epoch, 800), legacy)


def test_a_stretch_reads_only_the_shards_of_its_windows():
    order = WindowedOrder(SIZES, 5, window=2)
    starts = np.concatenate([[0], np.cumsum(SIZES)])
    position = 0
    while position < 3 * sum(SIZES):
        ahead = order.blocks_ahead(position, 16)
        ids = order.take(position, 16)
        shards = set((np.searchsorted(starts, ids, side="right") - 1).tolist())
        assert shards <= set(ahead), (position, shards, ahead)
        assert len(ahead) <= 2 * 2  # 16 samples cross at most two windows of two shards
        position += 16


def step_samples(order, position, world, global_batch=24, micro=2):
    accum = global_batch // (micro * world)
    ids = [
        rank_slice(order, position, global_batch=global_batch, micro_batch=micro, world_size=world, rank=r, micro=m)
        for m in range(accum)
        for r in range(world)
    ]
    return np.concatenate(ids)


@pytest.mark.parametrize("kind", ORDERS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 12])
def test_step_samples_do_not_depend_on_world_size(kind, world):
    order = ORDERS[kind]()
    reference = order.take(0, 24 * 40)
    for step in range(40):  # 40 steps of 24 cross an epoch boundary (800 samples)
        got = step_samples(order, step * 24, world)
        assert np.array_equal(np.sort(got), np.sort(reference[step * 24 : (step + 1) * 24]))


@pytest.mark.parametrize("kind", ORDERS)
def test_data_state_resumes_the_stream_at_another_world_size(kind):
    """Steps after a save at 2 ranks and a restore at 4 ranks are the uninterrupted run's steps."""
    order, state = ORDERS[kind](), TrainState()
    for _ in range(5):
        step_samples(order, state.data_position, 2)
        state.data_position += 24
    restored = TrainState()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    fresh = ORDERS[kind]()
    for step in range(5, 40):
        got = step_samples(fresh, restored.data_position, 4)
        assert np.array_equal(np.sort(got), np.sort(order.take(step * 24, 24)))
        restored.data_position += 24


def peak_bytes(build) -> int:
    tracemalloc.start()
    try:
        order = build()
        order.take(order.num_samples // 2, 64)
        order.blocks_ahead(order.num_samples // 3, 64)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_windowed_memory_is_flat_in_the_number_of_samples():
    """10^9 samples in 10^4 shards cost what 10^6 samples in 10^4 shards cost: two integers per shard."""
    small = peak_bytes(lambda: WindowedOrder([100] * 10_000, 1, window=64))
    large = peak_bytes(lambda: WindowedOrder([100_000] * 10_000, 1, window=64))
    assert large < 1.2 * small + 4096 and large < 1_000_000, (small, large)
    whole = peak_bytes(lambda: WindowedOrder([10**9], 1, window=64))  # no shards: one block
    assert whole < 100_000, whole
    assert peak_bytes(lambda: PermutationOrder(10**6, 1)) > 8 * 10**6  # what the windowed order avoids


def test_a_run_keeps_its_order_on_resume():
    assert chosen_order("auto", 64, None, resumed=False) == OrderSpec(WINDOWED, 64)
    assert chosen_order("permutation", 64, None, resumed=False) == OrderSpec(PERMUTATION)
    # a checkpoint from before the windowed order records none: it was the permutation, and stays so
    assert chosen_order("auto", 64, None, resumed=True) == OrderSpec(PERMUTATION)
    assert chosen_order("auto", 8, {"name": WINDOWED, "window": 64}, resumed=True) == OrderSpec(WINDOWED, 64)
    assert chosen_order("windowed", 64, {"name": WINDOWED, "window": 64}, resumed=True) == OrderSpec(WINDOWED, 64)
    with pytest.raises(UserError, match="data.order=windowed .* not the order this run's checkpoint was trained in"):
        chosen_order("windowed", 64, None, resumed=True)
    with pytest.raises(UserError, match=r"windowed \(window of 64 shards\)"):
        chosen_order("windowed", 8, {"name": WINDOWED, "window": 64}, resumed=True)


def test_make_order_and_shard_sizes():
    class Sharded:
        shard_sizes = (3, 4)

        def __len__(self):
            return 7

    assert shard_sizes_of(Sharded(), "train_data") == [3, 4]
    assert shard_sizes_of([1, 2, 3], "train_data") is None
    Sharded.shard_sizes = (3, 5)
    with pytest.raises(UserError, match=r"train_data.shard_sizes must be .* summing to len\(train_data\) = 7"):
        shard_sizes_of(Sharded(), "train_data")
    assert isinstance(make_order(OrderSpec(PERMUTATION), 7, 1, [3, 4]), PermutationOrder)
    assert make_order(OrderSpec(WINDOWED, 2), 7, 1, None).sizes.tolist() == [7]
