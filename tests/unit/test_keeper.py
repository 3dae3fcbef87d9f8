"""The launch's keeper (trainer/parallel/keeper.py) as a real process: it plans a spare into a dead rank's place the
moment the rank's socket closes, refuses sockets that do not hold the launch's key (their close sets off nothing),
and its plans cannot be forged by someone who reaches the store."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest

from hpc.spares import _listener
from rundir.contract import STORE_KEY_VAR
from tests.conftest import ROOT
from trainer.parallel.keeper import KeeperAddress, assign_key, plan_key, proof
from trainer.parallel.rejoin import KeeperLink


@pytest.fixture()
def keeper(tmp_path, request):
    key = secrets.token_bytes(32)
    store, live = _listener("127.0.0.1"), _listener("127.0.0.1")
    where = KeeperAddress("127.0.0.1", store.getsockname()[1], live.getsockname()[1])
    env = {**os.environ, STORE_KEY_VAR: key.hex(), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "trainer.parallel.keeper", "--store-fd", str(store.fileno()), "--live-fd",
               str(live.fileno()), "--addr", "127.0.0.1", "--world", "2", "--max-restarts", "5",
               "--run-dir", str(tmp_path), *getattr(request, "param", [])]  # fmt: skip
    proc = subprocess.Popen(command, env=env, pass_fds=(store.fileno(), live.fileno()), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    store.close()
    live.close()
    yield proc, where, key
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def closed(sock: socket.socket) -> bool:
    """Whether the keeper closed ``sock`` (cleanly, or with a reset: it closed with bytes left unread)."""
    try:
        return sock.recv(8) == b""
    except ConnectionResetError:
        return True


def hello(where: KeeperAddress, key: bytes, role: str, ident: int, node: str = "n1") -> socket.socket:
    sock = socket.create_connection((where.addr, where.live_port), timeout=30)
    nonce = sock.recv(64).decode().strip()
    sock.sendall(f"{role} {ident} {node} {proof(key, nonce, role, ident, node)}\n".encode())
    assert sock.recv(8) == b"ok\n"
    return sock


def test_a_dead_rank_gets_a_spare_and_strangers_set_off_nothing(keeper):
    proc, where, key = keeper
    link = KeeperLink(where, key, timeout_s=30)  # waits for the keeper's store (it imports torch first)
    link.hello("rank", 0, "n1")
    spare = hello(where, key, "spare", 0)
    rank1 = hello(where, key, "rank", 1)
    # Strangers: a wrong proof is refused, a posing rank's close sets off no plan, garbage closes its own socket.
    stranger = socket.create_connection((where.addr, where.live_port), timeout=10)
    nonce = stranger.recv(64).decode().strip()
    stranger.sendall(f"rank 1 n1 {proof(b'not the key', nonce, 'rank', 1, 'n1')}\n".encode())
    assert stranger.recv(8) == b""  # closed by the keeper
    stranger.close()
    for garbage in (b"rank 0 \xff\xfe\n", b"\x00" * 600, b"spare x y\n"):
        bad = socket.create_connection((where.addr, where.live_port), timeout=10)
        bad.recv(64)
        bad.sendall(garbage)
        assert closed(bad), garbage
        bad.close()
    # A forged plan in the store reads as nothing.
    forged = json.dumps({"v": json.dumps({"gen": 1, "spares": {"1": 7}}), "r": -1, "n": 1, "m": "0" * 64})
    link.store.set(plan_key(1), forged)
    time.sleep(0.5)
    assert link.read(plan_key(1)) is None
    # rank 1 dies: the keeper's plan (its own, sealed) replaces the forged value at once.
    died = time.monotonic()
    rank1.close()
    plan = link.wait(plan_key(1), 10.0)
    assert plan is not None and time.monotonic() - died < 2.0
    assert plan["dead"] == [1] and plan["spares"] == {"1": 0} and "fallback" not in plan, plan
    assert link.read(assign_key(0)) == {"gen": 1, "rank": 1}
    # The spare now stands for rank 1: its goodbye, then rank 0's, end the keeper.
    spare.sendall(b"bye\n")
    spare.close()
    link.bye()
    assert proc.wait(timeout=10) == 0, proc.stdout.read()


def test_no_spare_left_is_a_fallback(keeper):
    proc, where, key = keeper
    link = KeeperLink(where, key, timeout_s=30)
    link.hello("rank", 0, "n1")
    rank1 = hello(where, key, "rank", 1)
    rank1.close()
    plan = link.wait(plan_key(1), 10.0)
    assert plan["fallback"] == "1 rank(s) died and 0 warm spare(s) are left", plan
    link.bye()
    assert proc.wait(timeout=10) == 0


def test_a_rank_that_ends_the_launch_on_purpose_is_no_death_to_replace(keeper):
    """A rank that fails on purpose (a user error, a failure it reports) says "fail": the keeper tells the others
    to fall back at once and places no spare, though one waits; later closes set off nothing."""
    proc, where, key = keeper
    link = KeeperLink(where, key, timeout_s=30)
    link.hello("rank", 0, "n1")
    spare = hello(where, key, "spare", 0)
    rank1 = hello(where, key, "rank", 1)
    rank1.sendall(b"fail\n")
    rank1.close()
    plan = link.wait(plan_key(1), 10.0)
    assert plan["fallback"] == "rank 1 ended the launch" and "spares" not in plan, plan
    assert link.read(assign_key(0)) is None  # the waiting spare was given no place
    link.bye(b"fail")
    assert proc.wait(timeout=10) == 0
    spare.close()


def test_a_plan_never_leaves_the_launcher_without_its_own_ranks(keeper):
    """A death that would leave spares in every place the launcher's own rank processes held falls back: the
    launcher follows its own ranks (hpc/spawn.py ends with them)."""
    proc, where, key = keeper
    link = KeeperLink(where, key, timeout_s=30)
    spares = [hello(where, key, "spare", n) for n in range(2)]  # held open: a spare's close is its death
    ranks = [hello(where, key, "rank", r) for r in range(2)]
    ranks[0].close()
    assert link.wait(plan_key(1), 10.0)["spares"] == {"0": 0}
    ranks[1].close()  # spare 1 waits, but rank 1 was the launcher's last own rank process
    plan = link.wait(plan_key(2), 10.0)
    assert plan["fallback"] == "none of the launcher's own rank processes is left", plan
    assert link.read(assign_key(1)) is None
    os.kill(proc.pid, signal.SIGUSR1)  # the launcher: its ranks' starter ended
    assert proc.wait(timeout=10) == 0
    for sock in spares:
        sock.close()


@pytest.mark.parametrize("keeper", [["--silence-s", "3"]], indirect=True)
def test_a_silent_rank_is_counted_dead_and_no_spare_of_its_node_takes_its_place(keeper):
    """A lost node's sockets never close: a member unheard for monitor.peer_timeout_s (here 3 s) is counted dead,
    and with it the members of its node unheard for half that (their beats drift apart: one plan for the node). The
    plan names it silent with its address (the survivors cut their connections there) and places a spare of another
    node, though one of its own node still beats (the node may be going)."""
    proc, where, key = keeper
    links = [KeeperLink(where, key, timeout_s=30, beat_s=0.2) for _ in range(3)]
    links[0].hello("rank", 0, "n1")
    links[1].hello("spare", 0, "n2")
    links[2].hello("spare", 1, "n3")
    quiet = hello(where, key, "rank", 1, node="n2")  # never beats
    began = time.monotonic()
    drifted = hello(where, key, "spare", 2, node="n2")  # beats once, 0.5 s later: unheard over half the timeout
    time.sleep(0.5)
    drifted.sendall(b"beat\n")
    plan = links[0].wait(plan_key(1), 10.0)
    assert plan is not None and 2.9 < time.monotonic() - began < 10.0
    assert plan["dead"] == [1] and plan["silent"] == [1] and plan["spares"] == {"1": 1}, plan
    assert plan["addrs"] == {"1": "127.0.0.1"} and plan["lost_nodes"] == ["n2"], plan
    assert quiet.recv(16).startswith(b"gone"), "told, should it ever read"
    drifted.settimeout(0.3)  # counted dead with its node's rank (told before the plan), not later on its own
    assert drifted.recv(16).startswith(b"gone")
    assert links[0].read(assign_key(1)) == {"gen": 1, "rank": 1} and links[0].read(assign_key(0)) is None
    time.sleep(3.5)  # the beating ones are never counted dead
    assert links[0].read(plan_key(2)) is None
    for link in links:
        link.bye()
    assert proc.wait(timeout=10) == 0, proc.stdout.read()
