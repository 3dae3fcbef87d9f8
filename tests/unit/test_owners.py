"""The one owner rule (trainer/checkpoint/fingerprint.py ``owners_among``: largest first to the least-loaded holder,
ties to the lowest rank) kept by its heaps, against the rule written as a scan; and at 4,096 ranks, a restore's
share of the files to verify (trainer/checkpoint/reader.py ``shares``: 2 files a rank) in a fraction of the 3.8 s
the scan took on every rank."""

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


def test_a_restore_at_4096_ranks_shares_its_8194_files_at_once():
    world = 4096
    sizes = {f"dcp/__{r}_0.distcp": 10**9 + r % 3 for r in range(world)}
    sizes |= {f"rank_{r:05d}.pt": 16811 for r in range(world)} | {"dcp/.metadata": 5 << 20, "train_state.json": 900}
    started = time.perf_counter()
    got = shares(sizes, world)
    seconds = time.perf_counter() - started
    assert sorted(n for share in got for n in share) == sorted(sizes)
    assert all(1 <= len(share) <= 3 for share in got)  # the largest first, each rank about the same bytes
    assert seconds < 0.5, f"shares() at {world} ranks took {seconds:.2f} s"
    assert owners([5, 5, 9], 2) == [1, 1, 0]  # 9 to rank 0; both 5s to rank 1 (its 5 < 9)
