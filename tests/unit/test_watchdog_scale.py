"""Rank 0's watchdog at 4,096 ranks on a real store (trainer/observe/watchdog.py, beats.py): a hang claim whose
half of the ranks are behind names them by their ranges in a message of a few hundred bytes (it named each in a
sentence of its own: 24 KB into failure.json, the history and stdout), and its reads of every heartbeat and every
dump take a round trip per 256 keys (a node's record holds its ranks' beats), not one per rank. bench/scale.py
measures the rest with simulated ranks. What rank 0 keeps of 4,096 ranks' heartbeats between its reads: 34 bytes a
rank, and a read's peak a few hundred."""

import json
import os
import time
import tracemalloc
from datetime import timedelta

import pytest
import torch.distributed as dist

from runconfig.schema import MonitorConfig
from rundir import RunDir
from tests.unit.test_replicas import env_of
from trainer.observe.watchdog import HANG_KEY, Watchdog
from trainer.parallel.storeseal import Seal

WORLD, PER_NODE = 4096, 8


def test_a_hang_with_2048_ranks_behind_is_named_by_ranges_and_claimed_in_a_fraction_of_a_second(tmp_path):
    secret = os.urandom(32)
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    rundir = RunDir(tmp_path / "run")
    rundir.logs.mkdir(parents=True)
    cfg = MonitorConfig(heartbeat_s=2.0, hang_timeout_s=60.0)
    dog = Watchdog(env_of(WORLD, PER_NODE), cfg, rundir, "127.0.0.1", store.port, Seal(secret, 0))
    dog.exit = lambda code: (_ for _ in ()).throw(SystemExit(code))  # this process is the test's
    now, seals = time.time(), [Seal(secret, r) for r in range(WORLD)]
    records, dumped = {}, []
    for r in range(WORLD):  # the upper half is a phase behind the rest, who wait in the all-reduce since 70 s
        seq, phase = (7, "forward/backward") if r >= WORLD // 2 else (8, "gradient all-reduce")
        beat = {"seq": seq, "phase": phase, "step": 12, "since": now - 70, "beat": now}
        records.setdefault(r // PER_NODE, {})[str(r)] = beat  # a node's first rank writes its node's record
        if r:
            dumped.append((f"hpc/watchdog/dumped/{r}", seals[r].seal(f"hpc/watchdog/dumped/{r}", "1")))
    keys = [f"hpc/watchdog/beat/n{n}" for n in records]
    values = [
        seals[n * PER_NODE].seal(k, json.dumps({"beats": b})) for k, (n, b) in zip(keys, records.items(), strict=True)
    ]
    store.multi_set(keys, values)
    store.multi_set(*zip(*dumped, strict=True))  # every live rank has written its stacks: no wait for them
    store.get(dumped[-1][0])  # a round trip on this connection: the writes are in before rank 0 reads on its own
    dog.seq, dog.phase, dog.step, dog.since = 8, "gradient all-reduce", 12, now - 70

    started = time.perf_counter()
    with pytest.raises(SystemExit):
        dog._claim(dog._client(), 8)
    seconds = time.perf_counter() - started

    failure = json.loads(rundir.failure.read_text())
    message = failure["message"]
    assert "rank(s) 0-2047 waited" in message and "rank(s) 2048-4095 did not arrive" in message, message
    assert message.count("did not arrive: still in") == 8 and "and 2040 more" in message, message
    assert len(message) < 1500, len(message)
    assert len(failure["suspects"]) == WORLD // 2  # the record keeps every rank behind, with its node
    assert json.loads(Seal(secret, 1).open(HANG_KEY, store.get(HANG_KEY)))["rank"] == 0
    assert seconds < 3.0, f"rank 0's hang claim at {WORLD} ranks took {seconds:.2f} s"


def test_rank_0_keeps_34_bytes_a_rank_of_4096_ranks_heartbeats(tmp_path):
    secret = os.urandom(32)
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    cfg = MonitorConfig(heartbeat_s=2.0, hang_timeout_s=60.0, peer_timeout_s=15.0)
    dog = Watchdog(env_of(WORLD, PER_NODE), cfg, RunDir(tmp_path / "run"), "127.0.0.1", store.port, Seal(secret, 0))

    def publish(step: int) -> None:  # every node's first rank writes its node's record, as each heartbeat
        now, keys, values = time.time(), [], []
        for n in range(WORLD // PER_NODE):
            ranks = range(n * PER_NODE, (n + 1) * PER_NODE)
            beats = {str(r): {"seq": step, "phase": "forward/backward", "step": step, "since": now, "beat": now}
                     for r in ranks}  # fmt: skip
            keys.append(f"hpc/watchdog/beat/n{n}")
            values.append(Seal(secret, ranks[0]).seal(keys[-1], json.dumps({"beats": beats})))
        store.multi_set(keys, values)
        store.get(keys[-1])  # a round trip on this connection: the writes are in before rank 0 reads on its own

    publish(1)
    table = dog._read_beats()  # the table is made at the first read
    tracemalloc.start()
    try:
        for step in (2, 3, 4):
            publish(step)
            assert dog._read_beats() is table
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert table[4095] == {"seq": 4, "phase": "forward/backward", "step": 4, "since": table.since[4095],
                           "beat": table.beat[4095]}  # fmt: skip
    arrays = (table.beat, table.since, table.seq, table.step, table.phase)
    assert sum(a.itemsize * len(a) for a in arrays) == 34 * WORLD
    assert kept < 8 * WORLD, f"rank 0 kept {kept / WORLD:.0f} more bytes a rank"  # nothing more a read
    assert peak < 400 * WORLD, f"a read's peak: {peak / WORLD:.0f} bytes a rank"  # one record parsed at a time
    assert not dog._lost_peers(dog._client(), time.time()), "every rank beat just now"
