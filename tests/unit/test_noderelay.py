"""A node's ranks through their first rank's store connections (trainer/observe/noderelay.py and the watchdog's use
of it): the hub keeps each member's latest heartbeat and names the members that answer a roll call; rank 0 reads one
record a node and no key a rank; a member whose hub goes away talks to the store itself; a claim reaches the members
through their hub; another user can neither reach a hub nor plant its folder; a killed launch's folder is swept."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from runconfig.schema import MonitorConfig
from rundir import RunDir
from rundir.contract import EXIT_HANG
from storage.private import UnsafeFolder
from tests.conftest import OTHER_USER_ENV, as_user
from tests.unit.test_replicas import env_of
from trainer.observe.noderelay import Hub, Spoke, relay_path, sweep
from trainer.observe.watchdog import CLOSE, HANG_KEY, Watchdog
from trainer.parallel.storeseal import Seal


def until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


def test_a_hub_keeps_each_members_last_beat_and_names_the_members_that_answer(tmp_path):
    hub = Hub(tmp_path / "relay" / "n0.sock", [1, 2, 3])
    try:
        assert (tmp_path / "relay").stat().st_mode & 0o777 == 0o700
        answering, frozen, leaving = (Spoke(hub.path, r, 5.0) for r in (1, 2, 3))
        for spoke, r in ((answering, 1), (frozen, 2), (leaving, 3)):
            spoke.send({"beat": {"rank": r, "phase": "forward/backward"}})
        until(lambda: len(hub.snapshot()) == 3)
        leaving.close()  # its process ended: its last beat stays, the hub waits for it no more
        until(lambda: hub.connected() == {1, 2})

        def answer() -> None:
            while (message := answering.recv(5.0)) is not None:
                if "call" in message:
                    answering.send({"answer": 1})

        threading.Thread(target=answer, daemon=True).start()
        started = time.monotonic()
        assert hub.roll_call(0.5) == {1}  # rank 2 reads nothing (frozen): the window runs out
        assert 0.45 < time.monotonic() - started < 3.0
        assert hub.snapshot()[3] == {"rank": 3, "phase": "forward/backward"}
        stranger = Spoke(hub.path, 9, 5.0)  # not a member of this node: dropped at its first message
        until(lambda: stranger.recv(5.0) is None)
    finally:
        hub.close()
    assert not (tmp_path / "relay").exists()


def end(dog: Watchdog, code: int) -> None:
    """A rank's end in this process: its threads stop (a real rank's process is gone)."""
    dog.exits.append(code)
    dog._stop.set()


def release(store: dist.TCPStore, dogs: list[Watchdog]) -> None:
    """The threads of ranks that ended in this process, woken and ended before their store goes with the test."""
    for dog in dogs:
        dog._stop.set()
        key = dog._call_key(dog.env.rank)
        store.set(key, dog.seal.seal(key, CLOSE))
        if dog.hub is not None:
            dog.hub.close()
    for dog in dogs:
        for thread in (dog._thread, dog._answerer, dog._guarder):
            thread.join(timeout=5)


def watchdogs(tmp_path, world: int, per_node: int, cfg: MonitorConfig) -> tuple[dist.TCPStore, list[Watchdog]]:
    secret = os.urandom(32)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    rundir = RunDir(tmp_path / "run")
    rundir.logs.mkdir(parents=True)
    env = dataclasses.replace(env_of(world, per_node), launch_id=f"relay-{os.getpid()}-{time.monotonic_ns()}")
    dogs = []
    for r in range(world):
        dog = Watchdog(dataclasses.replace(env, rank=r), cfg, rundir, "127.0.0.1", store.port, Seal(secret, r),
                       heartbeats=True)  # fmt: skip
        dog.exits, dog.dumps = [], []
        dog.exit = lambda code, d=dog: end(d, code)
        dog.dump_stacks = lambda why="", d=dog: d.dumps.append(time.time())
        dogs.append(dog)
    return store, dogs


def test_rank_0_reads_one_record_a_node_and_a_member_whose_hub_went_away_writes_its_own(tmp_path):
    cfg = MonitorConfig(heartbeat_s=0.2, hang_timeout_s=0, peer_timeout_s=0)
    store, dogs = watchdogs(tmp_path, 4, 2, cfg)
    for dog in dogs:
        dog.start()
    try:
        until(lambda: {"hpc/watchdog/beat/n0", "hpc/watchdog/beat/n1"} <= set(store.list_keys()))
        until(lambda: len(dogs[0].beats_of(store, range(4))) == 4)
        assert not [k for k in store.list_keys() if re.fullmatch(r"hpc/watchdog/beat/\d+", k)]  # no key a rank
        for dog in dogs:
            dog.enter("forward/backward", 7)
        until(lambda: all(b["step"] == 7 for b in dogs[0].beats_of(store, range(4)).values()))
        dogs[2].close()  # node 1's first rank leaves: rank 3 goes on alone
        until(lambda: "hpc/watchdog/beat/3" in store.list_keys())
        assert dogs[3].direct
        dogs[3].enter("forward/backward", 8)
        until(lambda: dogs[0].beats_of(store, [3])[3]["step"] == 8)
        assert dogs[0].beats_of(store, [2])[2]["phase"] == "finished"
    finally:
        for dog in (dogs[1], dogs[3], dogs[0]):
            dog.close()
    beats = dogs[0].beats_of(store, range(4))
    assert {r: b["phase"] for r, b in beats.items()} == dict.fromkeys(range(4), "finished")


def test_a_hang_claimed_by_a_member_reaches_every_rank_through_the_hubs(tmp_path, capsys):
    cfg = MonitorConfig(heartbeat_s=0.2, hang_timeout_s=1.5, peer_timeout_s=0)
    store, dogs = watchdogs(tmp_path, 4, 2, cfg)
    for dog in dogs:
        dog.start()
    stop = threading.Event()

    def steps() -> None:  # ranks 0-2 move on; rank 3 stays in its phase
        step = 0
        while not stop.is_set():
            step += 1
            for dog in dogs[:3]:
                dog.enter("forward/backward", step)
            time.sleep(0.1)

    dogs[3].enter("gradient all-reduce", 1)
    threading.Thread(target=steps, daemon=True).start()
    try:
        until(lambda: all(d.exits for d in dogs), 20.0)
    finally:
        stop.set()
    assert json.loads(dogs[0].seal.open(HANG_KEY, store.get(HANG_KEY)))["rank"] == 3
    assert all(d.exits[0] == EXIT_HANG for d in dogs), [d.exits for d in dogs]
    assert "got no answer" not in capsys.readouterr().out  # each followed the claim, none ended by its guard
    assert dogs[1].dumps and dogs[2].dumps and dogs[0].dumps  # the members through their hubs, rank 2 a hub
    message = json.loads(RunDir(tmp_path / "run").failure.read_text())["message"]
    assert "rank 3" in message and "did not arrive" in message, message
    assert "hpc/watchdog/dumped/1" in store.list_keys()  # written by its hub, rank 0, for it
    release(store, dogs)


def test_another_user_can_neither_reach_a_hub_nor_plant_its_folder(tmp_path, other_user, other_user_python):
    hub = Hub(relay_path("t" + os.urandom(8).hex(), 0), [1])
    try:
        knock = "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])"
        tried = as_user(other_user, [*other_user_python, "-c", knock, str(hub.path)], env=OTHER_USER_ENV)
        assert tried.returncode != 0 and "PermissionError" in tried.stderr, tried.stderr
        assert hub.connected() == set()
    finally:
        hub.close()
    planted = relay_path("t" + os.urandom(8).hex(), 0)  # a folder of the other user's where a hub would listen
    assert as_user(other_user, ["mkdir", "-m", "755", str(planted.parent)]).returncode == 0
    try:
        with pytest.raises(UnsafeFolder, match="belongs to"):
            Hub(planted, [1])
        with pytest.raises((FileNotFoundError, ConnectionRefusedError)):
            Spoke(planted, 1, 0.2)
    finally:
        as_user(other_user, ["rmdir", str(planted.parent)])


def test_a_frozen_first_rank_is_claimed_alone_its_node_talking_to_the_store_itself(tmp_path):
    cfg = MonitorConfig(heartbeat_s=0.2, hang_timeout_s=0, peer_timeout_s=4.0)
    store, dogs = watchdogs(tmp_path, 4, 2, cfg)
    for dog in dogs:
        dog.start()
    until(lambda: len(dogs[0].beats_of(store, range(4))) == 4)
    dogs[2]._stop.set()  # node 1's first rank stops beating and relaying, its socket still open (frozen)
    until(lambda: dogs[0].exits, 20.0)
    assert dogs[3].direct  # three beats without a word from its hub: it talks to the store itself
    failure = json.loads(RunDir(tmp_path / "run").failure.read_text())
    assert [s["rank"] for s in failure["suspects"]] == [2], failure["message"]
    until(lambda: dogs[1].exits and dogs[3].exits)  # the others followed the claim, rank 3 through the store
    release(store, dogs)


def test_a_killed_launchs_relay_folder_is_swept_and_a_live_or_new_one_kept(tmp_path):
    def folder(name: str, listening: bool, age_s: float) -> Path:
        path = tmp_path / f"hpc-relay-{name}"
        path.mkdir(mode=0o700)
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path / "n0.sock"))  # the file stays after the socket closes, as a killed hub's does
        if listening:
            sock.listen()
            kept.append(sock)
        else:
            sock.close()
        os.utime(path, (time.time() - age_s,) * 2)
        return path

    kept: list[socket.socket] = []
    killed, live, young = folder("killed", False, 120), folder("live", True, 120), folder("young", False, 5)
    assert sweep(tmp_path) == [killed]
    assert not killed.exists() and live.exists() and young.exists()
