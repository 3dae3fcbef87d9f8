"""Against a REAL Slurm cluster (munge + slurmctld + 2 slurmd from Debian) started by envs/slurm/cluster.sh.

Jobs go through `python -m hpc.submit` exactly as a user's would; preemption is real: the job's signal sent by
scancel, an external `scontrol requeue`, and a job in a higher-priority partition.
"""

import json
import os
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.slurm

PORTS = {"HPC_SLURM_CTLD_PORT": "16917", "HPC_SLURM_NODE_PORT": "17101"}  # apart from a developer's own cluster


@pytest.fixture(scope="module")
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


def sets_for(data) -> list[str]:
    return [
        f"data.path={data}", "train.steps=60", "train.warmup_steps=2", "train.eval_every=20",
        "model.d_model=64", "model.n_layers=2", "model.seq_len=64", "checkpoint.every_steps=10",
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


def wait_step(run_dir, step, timeout=120) -> None:
    deadline = time.monotonic() + timeout
    path = Path(run_dir) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and any(json.loads(x).get("step", 0) >= step for x in path.read_text().splitlines() if x):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {run_dir}")


def summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def history(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "history.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_dataset):
    """The same config run locally (2 simulated nodes x 2 ranks): the Slurm runs must end bit-identical."""
    run_dir = tmp_path_factory.mktemp("slurm-ref") / "run"
    args = ["-m", "hpc.submit", "tiny", "--local", "--run-dir", str(run_dir)]
    for s in sets_for(small_dataset):
        args += ["--set", s]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return summary(run_dir)["params_sha256"]


def test_two_nodes_two_ranks_each(slurm, small_dataset, reference, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, sets_for(small_dataset))
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    assert info["JobState"] == "COMPLETED", info
    assert summary(run_dir)["params_sha256"] == reference
    nodes = {}
    for rank in range(4):
        line = (run_dir / "logs" / f"rank_{rank:05d}.log").read_text().splitlines()[0]
        nodes[rank] = line.split("(slurm node ")[1].split(")")[0]
    assert nodes == {0: "n1", 1: "n1", 2: "n2", 3: "n2"}  # really spread over both nodes, in blocks
    assert (run_dir / f"job_{job_id}.sbatch").read_text().count("#SBATCH --nodes=2") == 1
    for path in (run_dir, run_dir / "slurm", run_dir / "slurm" / job_id):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert history(run_dir)[0]["slurm_job_id"] == job_id


def resumed_bitwise(run_dir, job_id, reference) -> dict:
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
    assert info["JobState"] == "COMPLETED", info
    assert int(info["Restarts"]) >= 1, info
    events = history(run_dir)
    resumes = [e for e in events if e["event"] == "resume"]
    assert resumes and resumes[0]["slurm_restart_count"] >= 1 and resumes[0]["slurm_job_id"] == job_id
    assert summary(run_dir)["params_sha256"] == reference
    return info


def test_preempted_by_the_job_signal(slurm, small_dataset, reference, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, sets_for(small_dataset))
    wait_step(run_dir, 10)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)  # to the job's steps: every rank
    resumed_bitwise(run_dir, job_id, reference)
    stopped = [e for e in history(run_dir) if e["event"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["step"] >= 10


def test_requeued_by_scontrol(slurm, small_dataset, reference, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, sets_for(small_dataset))
    wait_step(run_dir, 10)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    resumed_bitwise(run_dir, job_id, reference)


def test_preempted_by_a_higher_priority_partition(slurm, small_dataset, reference, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, sets_for(small_dataset))
    wait_step(run_dir, 10)
    urgent = subprocess.run(
        ["sbatch", "--parsable", "-p", "urgent", "-N2", "--ntasks-per-node=4", f"--output={tmp_path}/urgent.out",
         "--wrap", "sleep 2"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    wait_state(urgent, {"COMPLETED"}, timeout=180)
    resumed_bitwise(run_dir, job_id, reference)
    assert any(e["event"] == "stopped" for e in history(run_dir))  # the trainer saw the preemption signal
