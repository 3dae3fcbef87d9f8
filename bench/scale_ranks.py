"""bench/scale.py's two kinds of process: rank 0 (the rendezvous store's server and rank 0's watchdog, as in a
launch) and a host of simulated ranks (each with the store connections and watchdog threads of a real rank). Both run
the package's own code (trainer/observe/watchdog.py, trainer/parallel/storeseal.py); no model, no gloo.

The orchestrator talks to them through files in a private work folder: ``port`` (rank 0's store), ``go/NAME``
(commands), ``ranks_K.json`` (what host K saw)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from runconfig.schema import MonitorConfig
from rundir import RunDir
from trainer.env import RuntimeEnv
from trainer.observe.beats import READ_CHUNK
from trainer.observe.watchdog import Watchdog
from trainer.parallel.distributed import store_listener
from trainer.parallel.storeseal import Seal
from trainer.parallel.topology import Topology

STEP_S = 0.5  # how often a simulated rank enters a new phase (a step's forward/backward, then its all-reduce)


def make_env(rank: int, world: int, per_node: int, work: Path) -> RuntimeEnv:
    nodes = tuple(f"node{r // per_node:05d}" for r in range(world))  # simulated nodes of one real host
    return RuntimeEnv(
        rank=rank, world_size=world, host_local_rank=rank % per_node, host_local_size=per_node,
        hostname="localhost", slurm_node=None, hosts=("localhost",) * world, one_network=True, node_names=nodes,
        topology=Topology(world, per_node), simulated_nodes=True, cpus=1, slurm_job_id=None,
        slurm_restart_count=None, data_cache=work, launch_id="scale",
    )  # fmt: skip


class Counted(Watchdog):
    """A rank's watchdog whose store operations are counted (rank 0's read of every heartbeat record as two per
    chunk of keys, as when every key is there; a member's messages to its node's first rank are not the store's)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ops = 0

    def _set(self, store, key, value):  # noqa: ANN001
        self.ops += 1
        super()._set(store, key, value)

    def _get(self, store, key):  # noqa: ANN001
        self.ops += 1
        return super()._get(store, key)

    def _read_beats(self) -> dict[int, dict]:
        records = self.env.topology.num_nodes if self.relayed else self.env.world_size  # a node's, or a rank's
        self.ops += 2 * -(-records // READ_CHUNK)  # read_all's check and multi_get per chunk
        return super()._read_beats()


class SimRank(Counted):
    """A simulated rank: its end (a followed claim) ends its threads, not the process that hosts many ranks, and its
    stack dump is a line (the process' threads are not this rank's)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.saw_claim: float | None = None
        self.exit = self._end

    def dump_stacks(self, why: str = "hang watchdog") -> None:
        if self.saw_claim is None:
            self.saw_claim = time.time()

    def _end(self, code: int) -> None:
        self._stop.set()  # its guard thread ends too (a real rank's process is gone by now)
        raise SystemExit(code)  # in the watchdog thread: ends that thread only


def write_ops(work: Path, name: str, ops: int) -> None:
    (work / f"{name}.tmp").write_text(str(ops))
    os.replace(work / f"{name}.tmp", work / name)


def monitor(heartbeat_s: float, peer_timeout_s: float) -> MonitorConfig:
    return MonitorConfig(heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s, hang_timeout_s=600.0)


def wait_file(path: Path, timeout_s: float = 600.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.02)
    return path.read_text()


def rank0(work: Path, world: int, per_node: int, secret: bytes, cfg: MonitorConfig, relay: bool) -> None:
    """Rank 0 as in a launch: the store's server in this process, its own client and its watchdog. Ends when its
    watchdog claims a silent rank (os._exit, as a real rank 0 does) or when the orchestrator kills it."""
    env = make_env(0, world, per_node, work)
    listener = store_listener("127.0.0.1", env)  # as init_distributed opens it: its backlog fits the world
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60), master_listen_fd=listener.fileno())  # fmt: skip
    rundir = RunDir(work / "run")
    rundir.logs.mkdir(parents=True, exist_ok=True)
    dog = Counted(env, cfg, rundir, "127.0.0.1", store.port, Seal(secret, 0), relay=relay)
    write_ops(work, "port", store.port)
    wait_file(work / "go" / "start")  # every simulated rank is connected: the watchdogs start together
    dog.start()
    step = 0
    while True:
        step += 1
        dog.enter("forward/backward", step)
        write_ops(work, "ops_0", dog.ops)
        time.sleep(STEP_S)


def rearm(dogs: dict[int, SimRank], held: list) -> None:
    """Each rank's roll-call thread again: a roll call ends them (it follows a failed collective, after which a real
    rank exits), and the claim measured next reaches the ranks through them."""
    for (r, dog), store in zip(dogs.items(), held, strict=True):
        if dog._answerer.is_alive():  # a node's member: its thread reads its hub, and answered it
            continue
        store.delete_key(dog._call_key(r))
        dog._answerer = threading.Thread(target=dog._answer_roll_call, name="hpc-roll-call", daemon=True)
        dog._answerer.start()


def ranks(work: Path, host: int, first: int, last: int, world: int, per_node: int, secret: bytes,
          cfg: MonitorConfig, relay: bool) -> None:  # fmt: skip
    """Ranks first..last-1, each with its process group's store connection (held, idle) and its watchdog's."""
    threading.stack_size(256 * 1024)
    port = int(wait_file(work / "port"))
    rundir = RunDir(work / "run")
    held, dogs = [], {}
    for r in range(first, last):
        held.append(dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60)))
        dogs[r] = SimRank(make_env(r, world, per_node, work), cfg, rundir, "127.0.0.1", port, Seal(secret, r),
                          relay=relay)  # fmt: skip
    (work / f"ready_{host}").write_text("")
    go = work / "go"
    wait_file(go / "start")
    for dog in dogs.values():
        dog.start()
    step, roll_call, rearmed, silenced = 0, None, False, None
    while not (go / "end").exists():
        step += 1
        for dog in dogs.values():
            dog.enter("forward/backward", step)
        if roll_call is None and (go / f"rollcall_{host}").exists():
            t = time.perf_counter()
            text, suspects = dogs[last - 1].diagnose(RuntimeError("a collective failed (simulated)"))
            roll_call = {"s": time.perf_counter() - t, "named": [s["rank"] for s in suspects], "text": text}
            (work / f"rollcall_{host}.json").write_text(json.dumps(roll_call))
        if not rearmed and (go / "rearm").exists():
            rearm(dogs, held)
            rearmed = True
            (work / f"rearmed_{host}").write_text("")
        if silenced is None and (go / f"silence_{host}").exists():
            silenced = last - 1
            dogs[silenced]._stop.set()  # its heartbeats stop (a node lost with its link): no "finished" beat
            (work / f"silenced_{host}.json").write_text(json.dumps({"rank": silenced, "at": time.time()}))
        write_ops(work, f"ops_{host}", sum(d.ops for d in dogs.values()))
        time.sleep(STEP_S)
    seen = {r: d.saw_claim for r, d in dogs.items() if r != silenced}
    ops = sum(d.ops for d in dogs.values())
    (work / f"ranks_{host}.json").write_text(json.dumps({"saw_claim": seen, "ops": ops}))
    os._exit(0)  # the watchdog threads and store clients end with the process


def main(argv: list[str]) -> None:
    role, work = argv[0], Path(argv[1])
    world, per_node, heartbeat_s, peer_timeout_s = int(argv[2]), int(argv[3]), float(argv[4]), float(argv[5])
    relay = argv[6] == "1"
    secret = bytes.fromhex(sys.stdin.readline().strip())  # never on a command line or in a file
    cfg = monitor(heartbeat_s, peer_timeout_s)
    if role == "rank0":
        rank0(work, world, per_node, secret, cfg, relay)
    else:
        host, first, last = (int(x) for x in argv[7:10])
        ranks(work, host, first, last, world, per_node, secret, cfg, relay)


if __name__ == "__main__":
    main(sys.argv[1:])
