"""The local launcher's rank starter with job.spare_ranks (torch-free): ``python -m hpc.spawn N -- COMMAND...``
starts N copies of COMMAND, rank i with ``HPC_SPAWN_RANK=i`` and ``HPC_SPAWN_WORLD=N`` in its environment, and
waits for all of them.

Unlike mpirun it never ends the others when one dies: the survivors go on in a new generation with a spare in the
dead rank's place (trainer/parallel/keeper.py), or end the launch themselves. MPICH's hydra kills every rank at the
second death in a launch, whatever its flags (docs/measurements/recovery.md), so ranks with spares are not MPI
processes: the keeper's store is their rendezvous. Signals it gets are passed on to the ranks. Its exit status:
0 when every rank ended 0, else the first failed rank's (a signal's number for a rank killed by one, as mpirun).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rundir.contract import SPAWN_RANK_VAR, SPAWN_WORLD_VAR

#: what tells the launcher's rank watch (hpc/ranks.py) and the tests which process is which rank, as under hydra
PMI_RANK_VAR = "PMI_RANK"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or not args[0].isdigit() or args[1] != "--":
        print("usage: python -m hpc.spawn N -- COMMAND...", file=sys.stderr)
        return 2
    world, command = int(args[0]), args[2:]
    procs = []
    for rank in range(world):
        env = {**os.environ, SPAWN_RANK_VAR: str(rank), SPAWN_WORLD_VAR: str(world), PMI_RANK_VAR: str(rank)}
        procs.append(subprocess.Popen(command, env=env))

    def forward(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT):
        signal.signal(sig, forward)
    first_failed: int | None = None
    running = set(range(world))
    while running:
        for rank in sorted(running):
            code = procs[rank].poll()
            if code is None:
                continue
            running.discard(rank)
            if code and first_failed is None:
                first_failed = -code if code < 0 else code
        time.sleep(0.05)
    return first_failed or 0


if __name__ == "__main__":
    sys.exit(main())
