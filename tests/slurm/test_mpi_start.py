"""A reliable MPI start under ``srun --mpi=pmi2`` with the MPICH wheel (trainer/parallel/mpi_library.py).

slurmstepd reads each PMI-1 request with one read() of at most 1024 bytes; MPICH's UCX business cards are put in
segments whose lines can pass that, and a start then dies in MPI_Init. These tests pin the server's limit, that
the trainer's start stays far below it, and many multi-node starts in a row.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest

from storage import shm
from tests.conftest import PY, ROOT

pytestmark = pytest.mark.slurm

WORKERS = Path(__file__).parent / "workers"
START = [PY, str(WORKERS / "mpi_start.py")]


def srun(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(["srun", "--mpi=pmi2", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def request_bytes(out: subprocess.CompletedProcess) -> int:
    return int(re.search(r"request of (\d+) bytes", out.stdout).group(1))


def test_slurmstepd_reads_a_pmi1_request_of_at_most_1024_bytes(slurm):
    """The cause of the intermittent MPI_Init failures: a longer request is cut, its tail parsed as a new one."""
    fits = srun("-N1", "-n1", PY, str(WORKERS / "pmi1_request.py"), "900")
    assert request_bytes(fits) < 1024 and "cmd=put_result rc=0" in fits.stdout, fits.stdout + fits.stderr
    assert "not properly terminated" not in fits.stderr
    cut = srun("-N1", "-n1", PY, str(WORKERS / "pmi1_request.py"), "1022")  # as long as MPICH's segments go
    assert request_bytes(cut) > 1024, cut.stdout + cut.stderr
    assert "mpi/pmi2: value not properly terminated in client request" in cut.stderr
    # The cut tail parsed as a request of its own: slurmstepd logs either the tail (the signature the failing CI runs
    # showed) or that it does not begin with cmd=, depending on how its reads split the bytes (seen both ways here)
    assert "full request is: 3333" in cut.stderr or "request not begin with 'cmd='" in cut.stderr, cut.stderr


def test_the_trainers_mpi_start_makes_short_pmi_requests(slurm, tmp_path):
    """Every PMI request of a 2-node start with 4 ranks per node, as the trainer starts MPI, measured on the wire."""
    taps = tmp_path / "taps"
    taps.mkdir()
    out = srun("-N2", "--ntasks-per-node=4", PY, str(WORKERS / "pmi_tap.py"), str(taps), "--", *START)
    assert out.returncode == 0, out.stdout + out.stderr
    records = [json.loads((taps / f"rank{r}.json").read_text()) for r in range(8)]
    assert all(r["requests"] >= 5 for r in records)  # init, maxes, kvsname, gets, barrier: the tap saw them
    longest = max(r["longest"] for r in records)
    # One 16-byte OFI address per node (a 66-byte put). UCX cards were measured at 650-850 bytes per line here,
    # depending on the ranks per node and what the process had loaded: too close to 1024.
    assert longest < 256, records
    assert any("cmd=put" in r["longest_starts"] for r in records), records


def test_many_multi_node_starts_in_a_row(on_hosts):
    """25 starts of 2 nodes x 2 ranks on separate hosts (MPI's traffic between nodes crosses a network): every one
    comes up with the right layout, delivers rank 0's broadcast while rank 0 waits outside MPI (the trainer's
    rendezvous), none hangs, none leaves shared memory behind. (With OFI's automatic data progress about one start
    in ten hung in MPI_Init here; on one host, where the nodes share memory, none did.)

    /dev/shm is shared with the tests on the other worker, whose launches have segments of their own (stale for a
    moment when they kill ranks on purpose, until their launcher's sweep): only the segments that these starts'
    ranks mapped are checked, each one named by the ranks themselves."""
    for attempt in range(25):
        out = srun("-N2", "--ntasks-per-node=2", *START)
        assert out.returncode == 0, f"start {attempt}: {out.stdout}{out.stderr}"
        lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        assert sorted(r["rank"] for r in lines) == [0, 1, 2, 3], out.stdout
        nodes = {r["rank"]: r["node"] for r in lines}  # any two idle nodes: an earlier test's may still be completing
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3], nodes
        assert all(r["world"] == 4 and r["ranks"] == [0, 1, 2, 3] for r in lines)
        assert all(r["waited_s"] < 2 for r in lines), lines  # the broadcast arrived while rank 0 waited
        # The two ranks of a node share one segment, each node its own; every rank has ended: none may be left.
        segments = {r["rank"]: r["segments"] for r in lines}
        assert segments[0] == segments[1] != segments[2] == segments[3] and all(segments.values()), segments
        left = [name for names in segments.values() for name in names if (shm.SHM_DIR / name).exists()]
        assert not left, f"start {attempt} left {left} in {shm.SHM_DIR}"
