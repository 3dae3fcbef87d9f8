"""Bad nodes left out on a REAL Slurm cluster of separate hosts: four nodes, each slurmd in its own network, UTS and
mount namespace with its own address, joined by links shaped to 1 Gbit/s (envs/slurm/cluster.sh, HPC_SLURM_NETNS=1).
srun spreads the ranks over those hosts, MPI and gloo talk between them over the links, and the node a failure
points at is named in history with the evidence and never used again by the run: either in the same allocation
(the world shrinks, down to job.min_nodes) or in a new job submitted with --exclude.

The module starts its own cluster on the session cluster's ports + 20 (the session cluster keeps serving the other
tests, unchanged)."""

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from runconfig.contract import EVENT_RESTART, EVENT_RESUME
from tests.conftest import ROOT, history, rank_pids, summary
from tests.slurm.conftest import PORTS, job_info, job_log, sets_for, submit, wait_state, wait_step

pytestmark = pytest.mark.slurm
SETTINGS = {
    "HPC_SLURM_CTLD_PORT": str(int(PORTS["HPC_SLURM_CTLD_PORT"]) + 20),
    "HPC_SLURM_NODE_PORT": str(int(PORTS["HPC_SLURM_NODE_PORT"]) + 20),
    "HPC_SLURM_NODES": "4",
    "HPC_SLURM_NETNS": "1",
    "HPC_SLURM_LINK_RATE": "1gbit",
}


@pytest.fixture(scope="module")
def hosts_cluster():
    state = Path(tempfile.mkdtemp(prefix="hpc-slurm-hosts-test-", dir="/tmp"))
    state.chmod(0o755)  # the munge user must traverse it
    env = {k: v for k, v in os.environ.items() if k != "HPC_SLURM_ACCOUNTING"} | SETTINGS

    def cluster(verb: str, check: bool = True) -> None:
        out = subprocess.DEVNULL if verb == "install" else None
        subprocess.run(["bash", "envs/slurm/cluster.sh", verb, str(state)], check=check, cwd=ROOT, env=env, stdout=out)

    cluster("install")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")
    try:
        cluster("start")
        yield state
    finally:
        cluster("wipe", check=False)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def events_of(run_dir, name):
    return [e for e in history(run_dir) if e["event"] == name]


def netns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def assert_separate_hosts(run_dir, pids: dict[int, int], ranks_per_node: int) -> None:
    """The ranks of one node share a network namespace, two nodes never do; the preflight measured the links."""
    spaces = [netns(pids[r]) for r in sorted(pids)]
    per_node = [set(spaces[i : i + ranks_per_node]) for i in range(0, len(spaces), ranks_per_node)]
    assert all(len(s) == 1 for s in per_node) and len(set.union(*per_node)) == len(per_node), spaces
    assert netns(os.getpid()) not in spaces
    preflight = events_of(run_dir, "preflight")[0]
    assert all(n["inter_gbps"] > 0 for n in preflight["nodes"]), preflight


def test_a_killed_ranks_node_is_excluded_in_a_new_job_and_the_run_ends_bitwise(
    hosts_cluster, small_dataset, reference, tmp_path
):
    """2 nodes needed (job.min_nodes unset): rank 1 on n1 is killed, n1 is named, and the run continues in a new job
    excluding n1 (a running job's exclusions cannot change; a requeue could land on n1 again): on n2 and n3, same
    world size, bit-identical to the uninterrupted run (run locally on one host)."""
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, [*sets_for(small_dataset), "job.restart_backoff_s=0.5"])
    wait_step(run_dir, 12)
    pids = rank_pids(run_dir)
    assert_separate_hosts(run_dir, pids, 2)
    os.kill(pids[1], signal.SIGKILL)
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    assert info["JobState"] == "COMPLETED", f"{info}\n{job_log(run_dir, job_id)}"
    jobs = [json.loads(line) for line in (run_dir / "jobs.jsonl").read_text().splitlines()]
    assert len(jobs) == 2 and jobs[1]["exclude"] == ["n1"] and jobs[1]["reason"] == "exclude", jobs
    new_id = jobs[1]["job_id"]
    info = wait_state(new_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    assert info["JobState"] == "COMPLETED", f"{info}\n{job_log(run_dir, new_id)}"
    assert info["ExcNodeList"] == "n1" and info["NodeList"] == "n[2-3]", info
    bad = events_of(run_dir, "bad_node")
    assert [e["node"] for e in bad] == ["n1"] and "rank 1" in bad[0]["evidence"], bad
    restart = events_of(run_dir, EVENT_RESTART)
    assert len(restart) == 1 and restart[0]["how"] == "new job" and restart[0]["excluded"] == ["n1"], restart
    resumed = events_of(run_dir, EVENT_RESUME)[-1]
    assert resumed["slurm_job_id"] == new_id and resumed["nodes"] == ["n2", "n3"], resumed
    assert f"the run continues in job {new_id} (--exclude=n1)" in job_log(run_dir, job_id)
    assert summary(run_dir)["params_sha256"] == reference


def test_a_nodes_ranks_all_killed_shrink_the_run_in_the_job(hosts_cluster, small_dataset, tmp_path):
    """3 nodes x 1 rank, job.min_nodes=2: the rank on n2 is killed; the driver names n2 and restarts the ranks in the
    same allocation on n1 and n3 (2 ranks, gradient accumulation 2 -> 3, the same global batch of 24); n2 is not
    used again."""
    run_dir = tmp_path / "run"
    shape = ["job.nodes=3", "job.ranks_per_node=1", "job.min_nodes=2"]
    batch = ["train.global_batch_size=24", "train.micro_batch_size=4"]
    job_id = submit(run_dir, [*sets_for(small_dataset), *shape, *batch, "job.restart_backoff_s=0.5"])
    wait_step(run_dir, 12)
    pids = rank_pids(run_dir)
    assert_separate_hosts(run_dir, pids, 1)
    os.kill(pids[1], signal.SIGKILL)
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    log = job_log(run_dir, job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{log}"
    assert [e["node"] for e in events_of(run_dir, "bad_node")] == ["n2"], history(run_dir)
    restart = events_of(run_dir, EVENT_RESTART)
    assert len(restart) == 1 and restart[0]["how"] == "in-job" and restart[0]["nodes"] == ["n1", "n3"], restart
    started = [e for e in history(run_dir) if e["event"] in ("start", EVENT_RESUME)]
    assert [(e["nodes"], e["world_size"], e["grad_accum"]) for e in started] == [
        (["n1", "n2", "n3"], 3, 2),
        (["n1", "n3"], 2, 3),
    ], started
    assert "--nodes=2 --ntasks=2 --nodelist=n1,n3" in log, log
    assert summary(run_dir)["world_size"] == 2 and summary(run_dir)["final_step"] == 60
    assert job_info(job_id)["NodeList"] == "n[1-3]"
