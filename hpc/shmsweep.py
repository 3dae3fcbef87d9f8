"""``python -m hpc.shmsweep``: this node's stale MPI shared-memory segments removed (storage/shm.py), one task per
node of an allocation after a launch that failed, or by hand."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rundir.slurmvars import slurm_node_name
from storage.shm import SHM_DIR, sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.shmsweep", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=SHM_DIR, help="where the segments are (default /dev/shm)")
    args = parser.parse_args(argv)
    removed = sweep(args.dir)
    host, node = os.uname().nodename, slurm_node_name(os.environ)
    where = f"{host} (slurm node {node})" if node else host
    print(f"{where}: removed {len(removed)} stale MPI shared-memory segment(s) from {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
