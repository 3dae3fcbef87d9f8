"""Another user of the cluster finds a running launch's rendezvous store (a TCP port on the rendezvous address, with
no password) and writes to it: forged heartbeats and hang claims, old heartbeats replayed, garbage, keys deleted. The
launch trains on to the end: every value the package reads back is sealed with the launch's secret
(trainer/parallel/storeseal.py), the rest is ignored and counted in the ranks' logs, no launch ends and no node is
named bad. The attacker is a real second Unix user (tests/conftest.py's other_user)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from rundir.contract import EVENT_BAD_NODE, EVENT_HANG, INJECT_VAR
from tests.conftest import OTHER_USER_ENV, PY, ROOT, as_user, history, rank_pids, summary

pytestmark = pytest.mark.mp

ATTACK = r"""
import json, sys, threading, time
from datetime import timedelta
import torch.distributed as dist

ports, seconds = [int(p) for p in sys.argv[1].split(",")], float(sys.argv[2])


def connect(port, timeout=0.5):
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))


store, given_up = None, time.time() + 20
while store is None and time.time() < given_up:  # a port scan, until the store holds the watchdog's keys
    for port in ports:
        try:
            candidate = connect(port)
            if any(k.startswith("hpc/watchdog/beat/") for k in candidate.list_keys()):
                store = candidate
                break
        except Exception:
            pass
    time.sleep(0.2)
assert store is not None, f"no store among {ports}"
beats = sorted(k for k in store.list_keys() if k.startswith("hpc/watchdog/beat/"))
old = {k: store.get(k) for k in beats}  # genuine values, replayed later
time.sleep(1.0)
forged_beat = json.dumps({"seq": 0, "phase": "x", "step": 0, "since": 1.0, "beat": 1.0})
forged = json.dumps({"v": forged_beat, "r": 0, "n": 10**9, "m": "0" * 64})
claim = json.dumps({"v": json.dumps({"rank": 0, "message": "forged hang"}), "r": 0, "n": 10**9, "m": "0" * 64})
# One kind a second: old values replayed, forged seals, garbage, deleted keys; each written the moment the rank has
# written its own heartbeat (the key deleted, then waited for), so that the readers meet it.
kinds = [lambda s, k: s.set(k, old[k]), lambda s, k: s.set(k, forged), lambda s, k: s.set(k, b"\xff garbage"),
         lambda s, k: s.delete_key(k)]
claims = ["garbage", claim, json.dumps({"rank": 0, "message": "forged"}), claim]
start, writes = time.time(), [0]


def phase():
    return int(time.time() - start) % len(kinds)


def follow(key):
    mine = connect(port, timeout=5)
    while time.time() < start + seconds:
        try:
            mine.delete_key(key)
            mine.wait([key], timedelta(seconds=2))
            kinds[phase()](mine, key)
            writes[0] += 2
        except Exception:  # no write within 2 s, or the launch ended
            if time.time() > start + seconds:
                break


threads = [threading.Thread(target=follow, args=(key,), daemon=True) for key in beats]
for t in threads:
    t.start()
while time.time() < start + seconds:
    try:
        store.set("hpc/watchdog/hang", claims[phase()])
        for r in range(len(beats)):
            store.set(f"hpc/watchdog/call/{r}", "roll call")
        writes[0] += 1 + len(beats)
    except Exception:  # the launch ended: its store with it
        break
    time.sleep(0.02)
for t in threads:
    t.join(timeout=5)
print(port, writes[0])
"""


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening(pid: int, other: int) -> dict[int, str]:
    """port -> local address (hex, as /proc/net/tcp* writes it) of the TCP sockets process ``pid`` listens on and
    process ``other`` does not (sockets both inherited, such as MPI's launcher's, left out), loopback ones first:
    what an attacker on the host finds with ``ss -tlnp``."""
    mine = socket_inodes(pid) - socket_inodes(other)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cells = line.split()
            if cells[3] == "0A" and cells[9] in mine:  # 0A: LISTEN
                address, port = cells[1].rsplit(":", 1)
                found.append((address != "0100007F", int(port, 16), address))
    return {port: address for _, port, address in sorted(found)}


def rank_log(run_dir: Path) -> str:
    path = run_dir / "logs" / "rank_00000.log"
    return path.read_text() if path.exists() else ""


PLANTED = "import os, sys; open(os.path.join({folder!r}, 'imported'), 'a').write(__name__); sys.exit('planted')\n"


def test_another_user_writing_to_the_store_ends_no_launch_and_names_no_node(
    tmp_path, small_dataset, other_user, other_user_python, shared_scratch
):
    run_dir = tmp_path / "run"
    # The user submits from a shared folder where the other user put a torch.py and a trainer package: the ranks
    # start there, but never import from it (their import path is safe: hpc/local.py).
    planted = PLANTED.format(folder=str(shared_scratch))
    files = ("torch.py", "trainer/__init__.py", "trainer/__main__.py")
    plant = f"import os; os.mkdir('trainer'); [open(p, 'w').write({planted!r}) for p in {files!r}]"
    assert as_user(other_user, [*other_user_python, "-c", plant], cwd=shared_scratch).returncode == 0
    sets = [f"data.path={small_dataset}", "train.steps=45", "train.eval_every=0", "model.d_model=64",
            "model.n_layers=2", "model.seq_len=64", "checkpoint.every_steps=30", "job.nodes=2",
            "monitor.heartbeat_s=0.5", "monitor.peer_timeout_s=3", "monitor.hang_timeout_s=20"]  # fmt: skip
    args = [PY, "-m", "hpc.submit", "tiny", "--local", "--run-dir", str(run_dir)]
    # 2 simulated nodes of 2 ranks, rank 1 0.3 s slower a step: 45 steps (13 s) outlast the attack (the port scan
    # and 8 s of writes)
    env = {**os.environ, "PYTHONPATH": str(ROOT), INJECT_VAR: "slow:1:0.3"}
    proc = subprocess.Popen([*args, *(f"--set={s}" for s in sets)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=shared_scratch)  # fmt: skip
    deadline = time.monotonic() + 120
    started = lambda: (run_dir / "history.jsonl").exists() and any(e["event"] == "start" for e in history(run_dir))  # noqa: E731
    while not started():  # the ranks train: their heartbeats are out
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    # Where the store listens (rank 0's log says; an attacker finds it by a scan of the host's ports): on the
    # rendezvous address alone, not on every interface.
    said = re.search(r"rendezvous store on 127\.0\.0\.1:(\d+) \(listening on 127\.0\.0\.1\)", rank_log(run_dir))
    assert said, rank_log(run_dir)
    pids = rank_pids(run_dir)
    assert listening(pids[0], pids[1]).get(int(said.group(1))) == "0100007F"
    attack = as_user(other_user, [*other_user_python, "-c", ATTACK, said.group(1), "8"], timeout=60,
                     env=OTHER_USER_ENV)  # fmt: skip
    out, err = proc.communicate(timeout=300)
    assert attack.returncode == 0, attack.stdout + attack.stderr
    assert int(attack.stdout.split()[-1]) > 200  # hundreds of values written while the launch ran
    assert proc.returncode == 0, out + err
    events = [e["event"] for e in history(run_dir)]
    assert EVENT_HANG not in events and EVENT_BAD_NODE not in events and events.count("start") == 1, events
    assert summary(run_dir)["final_step"] == 45
    assert not (shared_scratch / "imported").exists(), "a rank imported the other user's module"
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rank_*.log"))
    assert "someone else is writing to the store" in logs, logs[-3000:]
    # rank 0 reads node 1's record of its ranks' heartbeats (node 0's it holds): it met the kinds, and says so as its
    # launch ends (a replayed value is met only when rank 0 reads between the attacker's replay and rank 2's next
    # record: tests/unit/test_storeseal.py)
    total = re.search(r"rank 0 WARNING rendezvous store: in all, (.*) ignored", logs)
    assert total and all(f" {kind}" in total.group(1) for kind in ("forged", "garbage", "deleted")), total
    assert "rank(s) 2-3: heartbeats overwritten or deleted by someone else" in logs  # and not judged by them
