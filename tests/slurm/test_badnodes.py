"""Bad nodes left out on a REAL Slurm cluster of separate hosts: four nodes, each slurmd in its own network, UTS and
mount namespace with its own address, joined by links shaped to 1 Gbit/s (envs/slurm/cluster.sh, HPC_SLURM_NETNS=1).
srun spreads the ranks over those hosts, MPI and gloo talk between them over the links, and the node a failure
points at is named in history with the evidence and never used again by the run: either in the same allocation
(the world shrinks, down to job.min_nodes) or in a new job submitted with --exclude.

The cluster is tests/slurm/conftest.py's hosts_cluster (the session cluster keeps serving the other tests)."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from rundir import RunDir
from rundir.contract import EVENT_RESTART, EVENT_RESUME, INJECT_VAR
from rundir.identity import read_identity
from storage.nodememory import run_folder
from tests.conftest import ROOT, history, rank_pids, summary
from tests.slurm.conftest import TWO_NODES, job_info, job_log, rank_nodes, sets_for, submit, wait_state, wait_step

pytestmark = pytest.mark.slurm


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
    on_hosts, small_dataset, reference, tmp_path
):
    """2 nodes needed (job.min_nodes unset): rank 1 on n1 is killed, n1 is named, and the run continues in a new job
    excluding n1 (a running job's exclusions cannot change; a requeue could land on n1 again): on two of n2-n4, same
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
    # Slurm picks any two of n2-n4 (one still completing the first job may be passed over): what holds is the exclusion
    hostnames = ["scontrol", "show", "hostnames", info["NodeList"]]
    nodes = subprocess.run(hostnames, capture_output=True, text=True, check=True).stdout.split()
    assert info["ExcNodeList"] == "n1" and len(nodes) == 2 and "n1" not in nodes, info
    bad = events_of(run_dir, "bad_node")
    assert [e["node"] for e in bad] == ["n1"] and "rank 1" in bad[0]["evidence"], bad
    restart = events_of(run_dir, EVENT_RESTART)
    assert len(restart) == 1 and restart[0]["how"] == "new job" and restart[0]["excluded"] == ["n1"], restart
    resumed = events_of(run_dir, EVENT_RESUME)[-1]
    assert resumed["slurm_job_id"] == new_id and resumed["nodes"] == nodes, resumed
    assert f"the run continues in job {new_id} (--exclude=n1)" in job_log(run_dir, job_id)
    assert summary(run_dir)["params_sha256"] == reference


def test_the_plain_script_continues_in_a_new_job_without_the_named_node(
    on_hosts, small_dataset, reference_2x1, tmp_path
):
    """sbatch/train.sbatch, 2 nodes x 1 rank needed: rank 1 is killed, its node is named, and the script submits
    its continuation (hpc.slurmctl resubmit: the same script, shape, limit and output, the node excluded; this job
    made non-requeueable), which resumes on two other nodes and ends bit-identical."""
    from tests.slurm.test_sbatch_scripts import sbatch

    run_dir, output = tmp_path / "run", tmp_path / "slurm.out"
    sets = [*sets_for(small_dataset), *TWO_NODES, "job.restart_backoff_s=0.5"]
    env = {"CONFIG": "tiny", "RUN_DIR": str(run_dir), "HPC_SET": " ".join(sets)}
    job_id = sbatch("train.sbatch", env, "--nodes=2", "--ntasks-per-node=1", "--time=10", f"--output={output}")
    wait_step(run_dir, 12, output=output)
    pids = rank_pids(run_dir)
    first = rank_nodes(run_dir)[1]
    os.kill(pids[1], signal.SIGKILL)
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    text = output.read_text()
    assert info["JobState"] == "COMPLETED" and info["Requeue"] == "0", (info, text)
    found = re.search(rf"the run continues in job (\d+) \(--exclude={first}\)", text)
    assert found, text
    new = wait_state(found.group(1), {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    assert new["JobState"] == "COMPLETED" and new["ExcNodeList"] == first, (new, output.read_text())
    assert new["TimeLimit"] == info["TimeLimit"] and new["StdOut"] == str(output), new
    resumed = events_of(run_dir, EVENT_RESUME)[-1]
    assert first not in resumed["nodes"] and len(resumed["nodes"]) == 2, resumed
    assert summary(run_dir)["params_sha256"] == reference_2x1


def test_a_chain_continues_in_its_next_link_without_the_named_node(on_hosts, small_dataset, reference_2x1, tmp_path):
    """A chain of 2 jobs of 2 nodes x 1 rank: rank 1 (on n2) is killed in the first; no new job is submitted (it
    would train the run beside the second link, which starts once the first ends): the pending link gets
    ExcNodeList=n2 and finishes the run on two other nodes, bit-identical."""
    run_dir = tmp_path / "run"
    last = submit(run_dir, [*sets_for(small_dataset), *TWO_NODES, "job.restart_backoff_s=0.5"], "--chain", "2")
    first = json.loads((run_dir / "jobs.jsonl").read_text().splitlines()[0])["job_id"]
    wait_step(run_dir, 12)
    assert rank_nodes(run_dir) == {0: "n1", 1: "n2"}
    os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
    info = wait_state(first, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    assert info["JobState"] == "COMPLETED", f"{info}\n{job_log(run_dir, first)}"
    assert f"the run continues in job {last}, the chain's next link (--exclude=n2)" in job_log(run_dir, first)
    info = wait_state(last, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    assert info["JobState"] == "COMPLETED", f"{info}\n{job_log(run_dir, last)}"
    assert info["ExcNodeList"] == "n2", info
    assert len((run_dir / "jobs.jsonl").read_text().splitlines()) == 2
    (resumed,) = events_of(run_dir, EVENT_RESUME)
    assert resumed["slurm_job_id"] == last and len(resumed["nodes"]) == 2 and "n2" not in resumed["nodes"], resumed
    assert summary(run_dir)["params_sha256"] == reference_2x1


def test_a_nodes_ranks_all_killed_shrink_the_run_in_the_job(on_hosts, small_dataset, tmp_path):
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


@contextlib.contextmanager
def node_lost(state, node: str):
    """Node ``node`` of the separate-hosts cluster lost as hardware is lost (envs/slurm/cluster.sh node-down: its link
    down, then its slurmd and every process on it killed); afterwards brought back and waited for (idle again)."""
    lost = time.time()
    subprocess.run(["bash", "envs/slurm/cluster.sh", "node-down", node, str(state)], check=True, cwd=ROOT)
    try:
        yield lost
    finally:
        subprocess.run(["bash", "envs/slurm/cluster.sh", "node-up", node, str(state)], check=True, cwd=ROOT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "down" in node_state(node):
            time.sleep(0.5)


def node_state(node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True).stdout


def test_a_lost_node_with_the_allocation_kept_shrinks_the_run_in_the_job(on_hosts, small_dataset, tmp_path):
    """job.no_kill (sbatch --no-kill), 3 nodes x 1 rank, job.min_nodes=2: n2 is lost with its link. The survivors,
    blocked in a collective with no closed connection to see, end the launch once its heartbeats have stopped for
    monitor.peer_timeout_s (before Slurm even marks it DOWN); the driver ends the srun that waits for the lost tasks
    and restarts the ranks on n1 and n3 in the same job, the same global batch."""
    run_dir = tmp_path / "run"
    shape = ["job.nodes=3", "job.ranks_per_node=1", "job.min_nodes=2", "job.no_kill=true"]
    batch = ["train.global_batch_size=24", "train.micro_batch_size=4", "train.steps=80"]
    watch = ["monitor.peer_timeout_s=6", "monitor.heartbeat_s=1", "job.restart_backoff_s=0.5"]
    memory = ["checkpoint.memory_every_steps=1"]  # n2's files have a copy on n3, its partner
    job_id = submit(run_dir, [*sets_for(small_dataset), *shape, *batch, *watch, *memory])
    wait_step(run_dir, 12)
    assert rank_nodes(run_dir) == {0: "n1", 1: "n2", 2: "n3"}
    folder = run_folder("/dev/shm", read_identity(RunDir(run_dir).identity).run_id)
    assert sorted(p.name for p in folder.iterdir()) == ["n1", "n2", "n3"]
    with node_lost(on_hosts, "n2") as lost:
        info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    log = job_log(run_dir, job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{log}"
    assert "#SBATCH --no-kill" in (run_dir / f"job_{job_id}.sbatch").read_text()
    hang = events_of(run_dir, "hang")
    assert len(hang) == 1 and "rank(s) 1 stopped publishing heartbeats" in hang[0]["message"], hang
    assert hang[0]["time"] - lost < 6 + 6, hang  # the survivors stopped waiting: peer_timeout_s and a beat or two
    bad = events_of(run_dir, "bad_node")
    assert [e["node"] for e in bad] == ["n2"] and "heartbeats" in bad[0]["evidence"], bad
    restart = events_of(run_dir, EVENT_RESTART)
    assert len(restart) == 1 and restart[0]["how"] == "in-job" and restart[0]["nodes"] == ["n1", "n3"], restart
    resumed = events_of(run_dir, EVENT_RESUME)
    assert [(e["nodes"], e["world_size"], e["grad_accum"]) for e in resumed] == [(["n1", "n3"], 2, 3)], resumed
    # From the generation in node memory, completed from the partners' copies (n2's files from n3, n1's for n3),
    # not from the durable checkpoint every 10 steps; the driver's sweep removed the node folders at the end.
    restored = resumed[0]["restored_from"]
    assert restored["from"] == "memory" and restored["files_fetched"] > 0, restored
    assert resumed[0]["discarded_records"] <= 2, resumed  # the steps in flight at most, not up to 10
    assert not folder.exists(), sorted(folder.rglob("*"))
    # Loss to the restarted launch's processes started (their own start-up, as fast as this machine imports, comes
    # after): the survivors' timeout, the driver ending the srun that waited for n2, and a new srun.
    assert resumed[0]["process_start"] - lost < 40, resumed
    assert summary(run_dir)["final_step"] == 80 and summary(run_dir)["world_size"] == 2


def test_a_lost_node_fails_the_job_and_its_requeue_resumes_without_it(on_hosts, small_dataset, reference_2x1, tmp_path):
    """The allocation not kept (the default) and the survivors left waiting (monitor.peer_timeout_s=0): Slurm marks
    the lost n2 DOWN, ends the job with NODE_FAIL and requeues it; the requeued job's driver names n2 from Slurm's
    state, resumes on two healthy nodes, and the run ends bit-identical to the uninterrupted one (same world size)."""
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, [*sets_for(small_dataset), *TWO_NODES, "monitor.peer_timeout_s=0"])
    wait_step(run_dir, 12)
    hostnames = ["scontrol", "show", "hostnames", job_info(job_id)["NodeList"]]
    second = subprocess.run(hostnames, capture_output=True, text=True, check=True).stdout.split()[1]
    with node_lost(on_hosts, second) as lost:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not events_of(run_dir, EVENT_RESUME):
            time.sleep(0.5)
        info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    log = job_log(run_dir, job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{log}"
    assert f"due to failure of node {second}" in slurmctld_log(on_hosts) or "NODE FAILURE" in log, log
    bad = events_of(run_dir, "bad_node")
    assert [e["node"] for e in bad] == [second] and "DOWN" in bad[0]["evidence"], bad
    resumed = events_of(run_dir, EVENT_RESUME)
    assert len(resumed) == 1 and second not in resumed[0]["nodes"] and len(resumed[0]["nodes"]) == 2, resumed
    # Loss to the requeued job's ranks started (their own start-up, as fast as this machine imports, comes after)
    assert resumed[0]["slurm_restart_count"] == 1 and resumed[0]["process_start"] - lost < 120, resumed
    assert summary(run_dir)["params_sha256"] == reference_2x1


def slurmctld_log(state) -> str:
    return (state / "log" / "slurmctld.log").read_text(errors="replace")


def test_a_node_taken_back_by_hand_grows_the_run_back_in_the_chains_next_link(on_hosts, small_dataset, tmp_path):
    """4 nodes x 1 rank, job.min_nodes=3, a chain of 2: the rank on n2 is killed, the run shrinks to 3 nodes in the
    job and the pending link is kept off n2. `hpc unexclude RUN n2` takes it back and clears the link's exclusion;
    the first link is stopped by its signal, and the next link trains on all 4 nodes again, n2 among them, with the
    same global batch (gradient accumulation 3 -> 4 -> 3)."""
    run_dir = tmp_path / "run"
    # 36 steps: the first link resumes at its step-10 checkpoint and must not finish before the hand's work (a few
    # steps: measured under a second); the next link trains the rest on 4 nodes again, which proves nothing more per
    # step
    shape = ["job.nodes=4", "job.ranks_per_node=1", "job.min_nodes=3", "train.steps=36"]
    batch = ["train.global_batch_size=24", "train.micro_batch_size=2", "job.restart_backoff_s=0.5"]
    slow = f"job.env={json.dumps({INJECT_VAR: 'slow:0:0.05'})}"  # 0.05 s a micro-batch: the hand's work fits
    last = submit(run_dir, [*sets_for(small_dataset), *shape, *batch, slow], "--chain", "2")
    first = json.loads((run_dir / "jobs.jsonl").read_text().splitlines()[0])["job_id"]
    wait_step(run_dir, 12)
    pids = rank_pids(run_dir)
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not events_of(run_dir, EVENT_RESUME):
        time.sleep(0.5)
    resumed = events_of(run_dir, EVENT_RESUME)
    assert resumed and resumed[0]["nodes"] == ["n1", "n3", "n4"], f"{history(run_dir)}\n{job_log(run_dir, first)}"
    assert job_info(last)["ExcNodeList"] == "n2"  # the pending link is kept off the node named in the job
    took = subprocess.run(
        [sys.executable, "-m", "hpc", "unexclude", str(run_dir), "n2"], capture_output=True, text=True, cwd=ROOT
    )
    assert took.returncode == 0 and f"pending job(s) {last} now exclude nothing" in took.stdout, took
    assert job_info(last)["ExcNodeList"] == "(null)"
    subprocess.run(["scancel", "--signal=USR2", first], check=True)
    info = wait_state(last, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
    assert info["JobState"] == "COMPLETED", f"{info}\n{job_log(run_dir, last)}"
    started = [e for e in history(run_dir) if e["event"] in ("start", EVENT_RESUME)]
    assert [(e["nodes"], e["world_size"], e["grad_accum"]) for e in started] == [
        (["n1", "n2", "n3", "n4"], 4, 3),
        (["n1", "n3", "n4"], 3, 4),
        (["n1", "n2", "n3", "n4"], 4, 3),
    ], started
    assert started[-1]["slurm_job_id"] == last
    back = events_of(run_dir, "node_back")
    assert [(e["node"], e["how"]) for e in back] == [("n2", "by hand (python -m hpc unexclude)")], back
    assert summary(run_dir)["world_size"] == 4 and summary(run_dir)["final_step"] == 36
