"""hpc/spawn.py, the local launcher's rank starter with job.spare_ranks: every rank gets its number, one rank's
death ends no other (unlike mpirun, whose hydra ends them all at the second), and the status is the first failure's."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

PROGRAM = """
import os, signal, sys, time
rank = int(os.environ["HPC_SPAWN_RANK"])
assert os.environ["HPC_SPAWN_WORLD"] == "4" and os.environ["PMI_RANK"] == str(rank)
if rank in (1, 2):  # two deaths, one after the other
    time.sleep(0.2 * rank)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(1.0)
print(f"rank {rank} outlived them", flush=True)
sys.exit(3 if rank == 3 else 0)
"""


def test_the_others_outlive_a_dead_rank_and_the_first_failure_is_the_status():
    proc = subprocess.run([sys.executable, "-m", "hpc.spawn", "4", "--", sys.executable, "-c", PROGRAM], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert sorted(proc.stdout.split("\n")[:-1]) == ["rank 0 outlived them", "rank 3 outlived them"], proc.stderr
    assert proc.returncode == 9  # rank 1's SIGKILL, the first failure (rank 3's status 3 came later)


def test_a_bad_command_line_is_refused():
    proc = subprocess.run([sys.executable, "-m", "hpc.spawn", "x", "--", "true"], cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 2 and "usage: python -m hpc.spawn N -- COMMAND" in proc.stderr
