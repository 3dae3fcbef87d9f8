"""The local launcher's mpirun command (hpc/mpi.py, hpc/local.py): one segment per simulated node where a
per-node prefix is given (HPC_LOCAL_NODE_WRAP: benchmarks run each emulated node in a network namespace), and a
malformed prefix list refused with the variable named, before the run directory is made."""

import os
from pathlib import Path

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


FAKE_SBATCH = """#!/bin/sh
echo "$0 $*" >> "$(dirname "$0")/calls"
echo "Submitted batch job 1"
"""


@pytest.mark.parametrize(
    "sbatch_on_path,conf_exists,flag,target",
    [
        (True, True, [], "slurm"),  # a cluster's login node: sbatch and a cluster config
        (True, True, ["--local"], "local"),  # --local wins over a cluster that is there
        (True, False, [], "local"),  # Slurm's client installed, no cluster configured
        (False, True, [], "local"),  # no sbatch to submit with
    ],
)
def test_slurm_is_chosen_only_where_sbatch_and_a_cluster_config_are(
    tmp_path, monkeypatch, sbatch_on_path, conf_exists, flag, target
):
    """hpc.submit without --slurm or --local submits to Slurm when sbatch is on PATH and SLURM_CONF (or
    /etc/slurm/slurm.conf) names a file (hpc/slurmctl.py available), else launches here under mpirun. A dry run
    says which, and submits nothing: the stand-in sbatch (a real script on PATH) is never called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if sbatch_on_path:
        (bin_dir / "sbatch").write_text(FAKE_SBATCH)
        (bin_dir / "sbatch").chmod(0o755)
    # PATH without any real sbatch; mpirun is found beside this Python (the venv's pip-installed MPI)
    others = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "sbatch").exists()]
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), *others]))
    conf = tmp_path / "slurm.conf"
    if conf_exists:
        conf.write_text("ClusterName=stand-in\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    run_dir = tmp_path / "run"
    proc = run_cli(["-m", "hpc.submit", "tiny", "--dry-run", *flag, "--run-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"# run directory: {run_dir}", lines[:2]
    if target == "slurm":
        assert lines[1] == "#!/bin/bash" and any(line.startswith("#SBATCH --nodes=2") for line in lines), lines[:8]
        assert "# launch:" not in proc.stdout
    else:
        assert lines[1].startswith("# launch: ") and "mpirun" in lines[1] and "-n 4" in lines[1], lines[1]
        assert "#SBATCH" not in proc.stdout
    assert not (bin_dir / "calls").exists() and not run_dir.exists()  # a dry run submits and makes nothing
