"""The one owner rule (trainer/checkpoint/fingerprint.py ``owners_among``: largest first to the least-loaded holder,
ties to the lowest rank) kept by its heaps, against the rule written as a scan; and at 4,096 ranks, a restore's
share of the files to verify (trainer/checkpoint/reader.py ``shares``: 2 files a rank); the heaps measured against
the scan side by side."""

import random
import time

from trainer.checkpoint.fingerprint import owners, owners_among
from trainer.checkpoint.reader import shares


def by_scan(names: list, sizes: dict, holders: dict) -> dict:
    """The rule as it reads: each name, largest first, to the holder with the least load so far (then the lowest)."""
    load, out = {}, {}
    order = {n: i for i, n in enumerate(names)}
    for name in sorted(names, key=lambda n: (-sizes[n], order[n])):
        r = min(holders[name], key=lambda r: (load.get(r, 0), r))
        out[name] = r
        load[r] = load.get(r, 0) + sizes[name]
    return out


def test_the_heaps_give_the_scans_owners_with_shared_and_overlapping_holders():
    rng = random.Random(7)
    for _ in range(200):
        world = rng.randint(1, 12)
        groups = [sorted(rng.sample(range(world), rng.randint(1, world))) for _ in range(rng.randint(1, 4))]
        names = [f"p{i}" for i in range(rng.randint(1, 40))]
        sizes = {n: rng.choice([1, 2, 3, 8, 8, 100]) for n in names}  # ties on purpose
        holders = {n: rng.choice(groups) for n in names}  # shared lists, as a stage's names share one
        holders[names[0]] = sorted(set(holders[names[0]]) | {0})  # and one list of its own
        assert owners_among(names, sizes, holders) == by_scan(names, sizes, holders)


def restore_sizes(world: int) -> dict[str, int]:
    """A restore's files at ``world`` ranks: a DCP shard and a rank file each, the metadata and the train state."""
    sizes = {f"dcp/__{r}_0.distcp": 10**9 + r % 3 for r in range(world)}
    sizes |= {f"rank_{r:05d}.pt": 16811 for r in range(world)}
    return sizes | {"dcp/.metadata": 5 << 20, "train_state.json": 900}


def test_a_restore_at_4096_ranks_shares_its_8194_files_evenly():
    world = 4096
    sizes = restore_sizes(world)
    got = shares(sizes, world)
    assert sorted(n for share in got for n in share) == sorted(sizes)
    assert all(1 <= len(share) <= 3 for share in got)  # the largest first, each rank about the same bytes
    assert owners([5, 5, 9], 2) == [1, 1, 0]  # 9 to rank 0; both 5s to rank 1 (its 5 < 9)


def test_the_heaps_share_a_restore_many_times_faster_than_the_scan():
    # Side by side in one process, so that a loaded machine slows both; the best of three runs of each, and a floor
    # far below the heaps' lead (O(names x log ranks) against O(names x ranks)): a test of the order, not a clock.
    world = 1024
    sizes = restore_sizes(world)
    names = sorted(sizes)
    every = {n: list(range(world)) for n in names}

    def best(run) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return min(times)

    heaps = best(lambda: shares(sizes, world))
    scan = best(lambda: by_scan(names, sizes, every))
    assert scan > 5 * heaps, f"at {world} ranks the heaps took {heaps * 1e3:.1f} ms, the scan {scan * 1e3:.1f} ms"
