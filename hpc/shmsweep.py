"""``python -m hpc.shmsweep``: this node's stale MPI shared-memory segments removed (storage/shm.py), one task per
node of an allocation after a launch that failed, or by hand; with ``--run-id``, also that run's checkpoints in node
memory (storage/nodememory.py), once its job has no launch left."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rundir.slurmvars import slurm_node_name
from storage.nodememory import remove_run
from storage.shm import SHM_DIR, sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.shmsweep", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=SHM_DIR, help="where the segments are (default /dev/shm)")
    parser.add_argument("--run-id", help="also remove this run's checkpoints in node memory")
    parser.add_argument("--memory-dir", default="/dev/shm", help="checkpoint.memory_dir (default /dev/shm)")
    args = parser.parse_args(argv)
    removed = sweep(args.dir)
    host, node = os.uname().nodename, slurm_node_name(os.environ)
    where = f"{host} (slurm node {node})" if node else host
    print(f"{where}: removed {len(removed)} stale MPI shared-memory segment(s) from {args.dir}")
    if args.run_id and remove_run(args.memory_dir, args.run_id):
        print(f"{where}: removed run {args.run_id[:12]}'s checkpoints in node memory from {args.memory_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
