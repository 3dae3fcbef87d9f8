"""Worker: the watchdog's roll call after a failed collective (trainer/observe/watchdog.py ``diagnose``), on real
process groups and the real rendezvous store. Argument 2 is the rank that stops answering (SIGSTOP on itself: a
frozen rank; one that ended would make hydra end the whole job), -1 for none. Each rank that is not frozen runs
the roll call and writes what it found and how long it took; then rank 0 wakes the frozen rank and all leave."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

from runconfig.schema import CommConfig, MonitorConfig
from rundir import RunDir
from trainer.env import from_mpi
from trainer.observe.watchdog import Watchdog
from trainer.parallel.distributed import init_distributed, shutdown
from trainer.parallel.storeseal import Seal


def stopped(pid: int) -> bool:
    """The process is stopped by a signal (state T in /proc; every rank runs on this host)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


comm = MPI.COMM_WORLD
env = from_mpi(comm)
out, frozen = Path(sys.argv[1]), int(sys.argv[2])
d = init_distributed(env, CommConfig(timeout_s=60), torch.device("cpu"), comm)
seal = Seal(d.store_secret, env.rank)
watchdog = Watchdog(env, MonitorConfig(heartbeat_s=1.0, hang_timeout_s=30.0), RunDir(out), d.store_addr, d.store_port,
                    seal)  # fmt: skip
watchdog.start()
pids = comm.allgather(os.getpid())
time.sleep(0.5)  # the answering threads are waiting in the store
comm.Barrier()
if env.rank == frozen:
    os.kill(os.getpid(), signal.SIGSTOP)
else:
    while frozen >= 0 and not stopped(pids[frozen]):  # the roll call begins once the frozen rank has stopped
        time.sleep(0.01)
    start = time.monotonic()
    text, suspects = watchdog.diagnose(RuntimeError("a collective failed"))
    record = {"rank": env.rank, "text": text, "suspects": [s["rank"] for s in suspects]}
    record["seconds"] = time.monotonic() - start
    (out / f"rank_{env.rank}.json").write_text(json.dumps(record))
    if env.rank == 0 and frozen >= 0:
        deadline = time.monotonic() + 30
        others = [r for r in range(env.world_size) if r not in (0, frozen)]
        while not all((out / f"rank_{r}.json").exists() for r in others) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pids[frozen], signal.SIGCONT)
watchdog.close()
shutdown(comm, clean=True)
