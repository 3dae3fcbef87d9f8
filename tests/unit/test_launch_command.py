"""The local launcher's mpirun command (hpc/mpi.py, hpc/local.py): one segment per simulated node where a
per-node prefix is given (HPC_LOCAL_NODE_WRAP: benchmarks run each emulated node in a network namespace), and a
malformed prefix list refused with the variable named, before the run directory is made."""

import pytest

from hpc.local import node_wraps
from hpc.mpi import LauncherError, MpiLauncher
from runconfig import load_config
from rundir.contract import NODE_WRAP_VAR
from tests.conftest import run_cli

PROGRAM = ["python", "-m", "trainer", "--run-dir", "R"]


def test_plain_and_per_node_commands():
    mpich = MpiLauncher("/x/mpirun", "mpich")
    assert mpich.command(4, PROGRAM) == ["/x/mpirun", "-disable-auto-cleanup", "-n", "4", *PROGRAM]
    wraps = [["ip", "netns", "exec", "a"], ["ip", "netns", "exec", "b"]]
    assert mpich.command(4, PROGRAM, wraps) == [
        "/x/mpirun", "-disable-auto-cleanup",
        "-n", "2", "ip", "netns", "exec", "a", *PROGRAM, ":",
        "-n", "2", "ip", "netns", "exec", "b", *PROGRAM,
    ]  # fmt: skip


def test_node_wraps_follow_the_nodes_left(monkeypatch):
    cfg = load_config("tiny", ["job.nodes=3", "train.global_batch_size=48"])
    monkeypatch.delenv(NODE_WRAP_VAR, raising=False)
    assert node_wraps(cfg, ("node0", "node1", "node2")) is None
    monkeypatch.setenv(NODE_WRAP_VAR, "ip netns exec a|ip netns exec b|env X='1 2'")
    assert node_wraps(cfg, ("node0", "node2")) == [["ip", "netns", "exec", "a"], ["env", "X=1 2"]]
    monkeypatch.setenv(NODE_WRAP_VAR, "ip netns exec a|ip netns exec b")
    with pytest.raises(LauncherError, match=f"{NODE_WRAP_VAR} has 2 command prefixes.*3 nodes"):
        node_wraps(cfg, ("node0", "node1", "node2"))


def test_a_malformed_prefix_list_is_refused_before_anything_is_made(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(NODE_WRAP_VAR, "ip netns exec a")  # tiny has 2 nodes
    proc = run_cli(["-m", "hpc.submit", "tiny", "--local", "--run-dir", str(run_dir)])
    assert proc.returncode == 2 and NODE_WRAP_VAR in proc.stderr, proc.stderr
    assert not run_dir.exists()
