"""The real local Slurm cluster for these tests, and helpers to submit to it and watch jobs."""

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from rundir.paths import read_jsonl
from tests.conftest import ROOT, run_cli, summary

# Apart from a developer's own cluster (16817/17001); HPC_TEST_SLURM_CTLD_PORT / HPC_TEST_SLURM_NODE_PORT move them,
# so that two test sessions can run at once. Nodes use NODE_PORT, NODE_PORT + 1; the accounting test's own cluster
# the same + 10 (tests/slurm/test_accounting.py), the separate-hosts cluster + 20 (tests/slurm/test_badnodes.py).
# Each pytest-xdist worker that runs Slurm tests starts clusters of its own, 100 ports further per worker: the Slurm
# tests are two work units (tests/conftest.py's WorkUnits), which two workers may run at once. Their job ids are
# apart too (HPC_SLURM_FIRST_JOB_ID): the steps of two clusters' jobs of one id would share MPICH's shared-memory
# segments on this host, and hang in them.
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
PORTS = {
    "HPC_SLURM_CTLD_PORT": str(int(os.environ.get("HPC_TEST_SLURM_CTLD_PORT", "16917")) + 100 * WORKER),
    "HPC_SLURM_NODE_PORT": str(int(os.environ.get("HPC_TEST_SLURM_NODE_PORT", "17101")) + 100 * WORKER),
    "HPC_SLURM_FIRST_JOB_ID": str(1 + 100_000 * WORKER),
}


@pytest.fixture(scope="session")
def slurm():
    # Fresh state (job ids start at 1, no stale %j folders) in a folder the munge user can traverse (pytest's
    # own tmp folders are private to root).
    state = Path(tempfile.mkdtemp(prefix="hpc-slurm-test-", dir="/tmp"))
    state.chmod(0o755)
    env = {**os.environ, **PORTS}
    subprocess.run(["bash", "envs/slurm/cluster.sh", "install"], check=True, cwd=ROOT, env=env,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    subprocess.run(["bash", "envs/slurm/cluster.sh", "start", str(state)], check=True, cwd=ROOT, env=env)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")
    yield state
    subprocess.run(["bash", "envs/slurm/cluster.sh", "wipe", str(state)], cwd=ROOT, env=env, check=False)
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old


# A cluster of separate hosts (envs/slurm/cluster.sh, HPC_SLURM_NETNS=1): four nodes, each slurmd in its own network,
# UTS and mount namespace with its own address and host name, joined by links shaped to 1 Gbit/s. Ranks on two
# nodes talk over a network, as on a real cluster, not over loopback or shared memory. Ports: the session's + 20.
HOSTS = {
    "HPC_SLURM_CTLD_PORT": str(int(PORTS["HPC_SLURM_CTLD_PORT"]) + 20),
    "HPC_SLURM_NODE_PORT": str(int(PORTS["HPC_SLURM_NODE_PORT"]) + 20),
    "HPC_SLURM_FIRST_JOB_ID": str(int(PORTS["HPC_SLURM_FIRST_JOB_ID"]) + 60_000),
    "HPC_SLURM_NODES": "4",
    "HPC_SLURM_NETNS": "1",
    "HPC_SLURM_LINK_RATE": "1gbit",
    "HPC_SLURM_SLURMD_TIMEOUT": "10",  # a lost node is DOWN this long after its last answer (Slurm's default: 300 s)
    # the controller's ping of a lost node gives up after this (Slurm's default: 10 s), and the next round of pings
    # waits for it: with 10 s a lost node was DOWN ~30 s after its loss
    "HPC_SLURM_MESSAGE_TIMEOUT": "5",
}


@pytest.fixture(scope="session")
def hosts_cluster():
    state = Path(tempfile.mkdtemp(prefix="hpc-slurm-hosts-test-", dir="/tmp"))
    state.chmod(0o755)  # the munge user must traverse it
    env = {k: v for k, v in os.environ.items() if k != "HPC_SLURM_ACCOUNTING"} | HOSTS
    subprocess.run(["bash", "envs/slurm/cluster.sh", "install"], check=True, cwd=ROOT, env=env,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        subprocess.run(["bash", "envs/slurm/cluster.sh", "start", str(state)], check=True, cwd=ROOT, env=env)
        yield state
    finally:
        subprocess.run(["bash", "envs/slurm/cluster.sh", "wipe", str(state)], cwd=ROOT, env=env, check=False)


@pytest.fixture
def on_hosts(hosts_cluster, monkeypatch):
    """This test's Slurm commands and jobs go to the cluster of separate hosts."""
    monkeypatch.setenv("SLURM_CONF", str(hosts_cluster / "slurm.conf"))
    return hosts_cluster


def sets_for(data) -> list[str]:
    """comm.allreduce pinned: Slurm runs end bit-identical to a local reference only in one reduction order."""
    return [
        f"data.path={data}", "train.steps=60", "train.warmup_steps=2", "train.eval_every=20",
        "model.d_model=64", "model.n_layers=2", "model.seq_len=64", "checkpoint.every_steps=10",
        "comm.allreduce=hierarchical",
    ]  # fmt: skip


def submit(run_dir, sets, *extra) -> str:
    args = ["-m", "hpc.submit", "tiny", "--run-dir", str(run_dir), *extra]
    for s in sets:
        args += ["--set", s]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "submitted tiny as Slurm job" in proc.stdout
    return json.loads((Path(run_dir) / "jobs.jsonl").read_text().splitlines()[-1])["job_id"]


def job_info(job_id) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def wait_state(job_id, states, timeout=180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info.get("JobState") in states:
            return info
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not in {states} after {timeout} s: {job_info(job_id)}")


def wait_step(run_dir, step, timeout=120, output: Path | None = None) -> None:
    """Wait for ``step`` in metrics.jsonl; on a timeout the assertion shows the job's output (``output``, or the
    submitit logs) and the rank logs, so a job that died at start-up says why."""
    deadline = time.monotonic() + timeout
    path = Path(run_dir) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if any(r.get("step", 0) >= step for r in read_jsonl(path)):  # a line being written is skipped
            return
        time.sleep(0.2)
    shown = [output] if output else sorted((Path(run_dir) / "slurm").glob("*/*.out"))
    shown += sorted((Path(run_dir) / "logs").glob("rank_*.log"))
    tails = "\n".join(
        f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:]) for p in shown if p.exists()
    )
    raise AssertionError(f"step {step} not reached in {run_dir}\n{tails}")


def job_log(run_dir, job_id, lines=40) -> str:
    """The end of the driver's Slurm log and of each rank's log: what a failed assertion shows."""
    parts = []
    for path in sorted((Path(run_dir) / "slurm" / str(job_id)).glob("*.out")) + sorted(
        (Path(run_dir) / "logs").glob("rank_*.log")
    ):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {path}\n" + "\n".join(tail))
    return "\n".join(parts)


def rank_nodes(run_dir) -> dict[int, str]:
    """rank -> Slurm node name, from the first line of each rank's log."""
    nodes = {}
    for path in sorted((Path(run_dir) / "logs").glob("rank_*.log")):
        line = path.read_text().splitlines()[0]
        nodes[int(path.stem.removeprefix("rank_"))] = line.split("(slurm node ")[1].split(")")[0]
    return nodes


#: 2 nodes x 1 rank (a task per node), for the tests of the job's life (a signal, a preemption, a requeue cap): how
#: the ranks of a node share it under srun is pinned at 2 x 2 by the others, and a launch of 2 ranks starts in half
#: the time of 4 on the test machine's 2 cores. One thread per rank as in the local reference: Slurm's fake nodes
#: share this host, so a task alone on its node would take both cores and sum its matrix products in another order.
TWO_NODES = ["job.ranks_per_node=1", "job.threads_per_rank=1"]


def local_reference(tmp_path_factory, sets: list[str]) -> str:
    """params_sha256 of ``sets`` run locally: Slurm runs of them must end bit-identical."""
    run_dir = tmp_path_factory.mktemp("slurm-ref") / "run"
    args = ["-m", "hpc.submit", "tiny", "--local", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return summary(run_dir)["params_sha256"]


@pytest.fixture(scope="session")
def reference(tmp_path_factory, small_dataset):
    """sets_for's config run locally (2 simulated nodes x 2 ranks)."""
    return local_reference(tmp_path_factory, sets_for(small_dataset))


@pytest.fixture(scope="session")
def reference_2x1(tmp_path_factory, small_dataset):
    """sets_for's config on 2 simulated nodes x 1 rank (one thread each, as locally), run locally."""
    return local_reference(tmp_path_factory, [*sets_for(small_dataset), *TWO_NODES])
