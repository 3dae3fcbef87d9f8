"""sbatch/train.sbatch and sbatch/resume.sbatch submitted with plain sbatch to a REAL local Slurm cluster.

The cluster is the shared one of tests/slurm/conftest.py. The jobs run exactly as a user's would: the
environment carries CONFIG, RUN_DIR, HPC_SET and PYTHON; the stop is the job's signal sent by scancel; the
requeue is the script's own.
"""

import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rundir.contract import EVENT_DONE, EVENT_RESTART, EVENT_RESUME, EVENT_START, EVENT_STOPPED
from tests.conftest import ROOT, history, rank_pids, summary
from tests.slurm.conftest import TWO_NODES, rank_nodes, sets_for, wait_state, wait_step

pytestmark = pytest.mark.slurm

SCRIPTS = [ROOT / "sbatch" / name for name in ("train.sbatch", "resume.sbatch", "common.sh")]


def sbatch(script: str, env: dict, *options: str, cwd: Path = ROOT) -> str:
    """Submit sbatch/SCRIPT with these variables in the submitting environment; the job id."""
    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    for name in ("CONFIG", "HPC_SET", "HPC_REPO"):  # only what the test says
        if name not in env:
            full_env.pop(name, None)
    proc = subprocess.run(
        ["sbatch", "--parsable", *options, str(ROOT / "sbatch" / script)],
        capture_output=True, text=True, env=full_env, cwd=cwd,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def test_scripts_are_shellcheck_clean():
    """Every shell script of the project (the test command installs shellcheck: without it this test fails)."""
    assert shutil.which("shellcheck"), "shellcheck is not installed (bash tests/run.sh installs Debian's package)"
    others = [ROOT / p for p in ("envs/slurm/cluster.sh", "envs/modules.sh", "tests/run.sh", ".ci/run")]
    proc = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS + others)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_train_creates_the_run_and_completes_on_two_nodes(slurm, small_dataset, reference, tmp_path):
    # Submitted from the checkout's root (common.sh found via $SLURM_SUBMIT_DIR), the job's output kept in the
    # run directory, made beforehand as sbatch/README.md says.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {"CONFIG": "tiny", "RUN_DIR": str(run_dir), "HPC_SET": " ".join(sets_for(small_dataset))}
    job_id = sbatch("train.sbatch", env, "--nodes=2", "--ntasks-per-node=2", f"--output={run_dir}/slurm-%j.out")
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    output = (run_dir / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", output
    assert f"created run directory {run_dir} from tiny" in output
    assert "srun --mpi=pmi2 --kill-on-bad-exit=1" in output and "done: run" in output
    assert summary(run_dir)["final_step"] == 60
    assert summary(run_dir)["params_sha256"] == reference
    assert rank_nodes(run_dir) == {0: "n1", 1: "n1", 2: "n2", 3: "n2"}  # really on both nodes
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert "nodes: 2" in (run_dir / "config.yaml").read_text()
    assert [e["event"] for e in history(run_dir) if e["event"] != "preflight"] == [EVENT_START, EVENT_DONE]
    assert [e for e in history(run_dir) if e["event"] == "start"][0]["slurm_job_id"] == job_id


def test_stopped_by_the_job_signal_requeues_and_resumes_bitwise(slurm, small_dataset, reference_2x1, tmp_path):
    # Submitted from elsewhere, default --output (slurm-%j.out in the submit directory): common.sh is found via
    # the submitted script's path that `scontrol show job` records. 2 nodes x 1 rank (how the ranks of a node share
    # it under this script: the test above).
    run_dir = tmp_path / "run"
    env = {"CONFIG": "tiny", "RUN_DIR": str(run_dir), "HPC_SET": " ".join([*sets_for(small_dataset), *TWO_NODES])}
    job_id = sbatch("train.sbatch", env, "--nodes=2", "--ntasks-per-node=1", cwd=tmp_path)
    wait_step(run_dir, 10, output=tmp_path / f"slurm-{job_id}.out")
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)  # to the job's steps: every rank
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", output
    assert int(info["Restarts"]) >= 1, info
    assert f"checkpoint committed; scontrol requeue {job_id}" in output
    assert "exists: resuming this run" in output  # the requeued job did not create the run again
    events = history(run_dir)
    stopped = [e for e in events if e["event"] == EVENT_STOPPED]
    resumes = [e for e in events if e["event"] == EVENT_RESUME]
    assert len(stopped) == 1 and 10 <= stopped[0]["step"] < 60, events
    assert resumes and resumes[0]["step"] == stopped[0]["step"], events
    assert resumes[0]["slurm_job_id"] == job_id and resumes[0]["slurm_restart_count"] >= 1, events
    assert summary(run_dir)["params_sha256"] == reference_2x1


def test_a_killed_ranks_node_is_left_out_and_the_run_shrinks_in_the_job(slurm, small_dataset, tmp_path):
    """SIGKILL to rank 3 (on n2), job.min_nodes=1: the script asks hpc.policy.decide, which names n2 from srun's
    first failed-task line; the ranks restart in the same allocation on n1 alone (no requeue), the restart and
    the bad node are in history.jsonl with their evidence, and the run completes."""
    run_dir = tmp_path / "run"
    sets = [*sets_for(small_dataset), "job.restart_backoff_s=0.5", "job.min_nodes=1"]
    env = {"CONFIG": "tiny", "RUN_DIR": str(run_dir), "HPC_SET": " ".join(sets)}
    output = tmp_path / "slurm.out"
    job_id = sbatch("train.sbatch", env, "--nodes=2", "--ntasks-per-node=2", f"--output={output}")
    wait_step(run_dir, 12, output=output)
    os.kill(rank_pids(run_dir)[3], signal.SIGKILL)
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    text = output.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", (info, text)
    assert "restart 1 of at most 3 in 0.5 s from the newest valid checkpoint on 1 of 2 nodes (n1)" in text, text
    assert "srun --nodes=1 --ntasks=2 --nodelist=n1 --mpi=" in text, text
    events = history(run_dir)
    restarts = [e for e in events if e["event"] == EVENT_RESTART]
    assert len(restarts) == 1 and restarts[0]["status"] != 0 and restarts[0]["nodes"] == ["n1"], restarts
    bad = [e for e in events if e["event"] == "bad_node"]
    assert [e["node"] for e in bad] == ["n2"] and "rank 3" in bad[0]["evidence"], bad
    resumed = [e for e in events if e["event"] == EVENT_RESUME][-1]
    assert resumed["nodes"] == ["n1"] and resumed["world_size"] == 2, resumed
    assert summary(run_dir)["final_step"] == 60 and summary(run_dir)["world_size"] == 2


def test_resume_refuses_a_run_dir_without_config(slurm, tmp_path):
    run_dir = tmp_path / "no-run"
    job_id = sbatch("resume.sbatch", {"RUN_DIR": str(run_dir)}, f"--output={tmp_path}/slurm-%j.out")
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=60)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, output)
    assert int(info["Restarts"]) == 0
    assert f"error: {run_dir} is not a run directory (it has no config.yaml); nothing to resume." in output
    assert not run_dir.exists()  # nothing created


def test_train_refuses_spares_before_making_the_run(slurm, tmp_path):
    """job.spare_ranks needs the driver of python -m hpc.submit (its keeper, ranks without MPI): the plain script says
    so, naming the key, before it makes anything."""
    run_dir = tmp_path / "run"
    env = {"RUN_DIR": str(run_dir), "CONFIG": "tiny", "HPC_SET": "job.spare_ranks=1"}
    job_id = sbatch("train.sbatch", env, f"--output={tmp_path}/slurm-%j.out")
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=60)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, output)
    assert "job.spare_ranks=1: the plain sbatch scripts keep no warm spares" in output, output
    assert not (run_dir / "config.yaml").exists()


def test_sbatch_args_from_the_config_are_what_sbatch_accepts(slurm, tmp_path):
    """`python -m hpc sbatch-args CONFIG`: the job section (signal and its lead, time, partition, shape) as options
    for the plain scripts, checked by the real sbatch (--test-only: validated against the cluster, not queued)."""
    sets = ["job.signal=SIGUSR1", "checkpoint.stop_signals=[SIGUSR1,SIGTERM]", "job.signal_lead_s=45"]
    sets += ["job.time=25:00", "job.partition=urgent", "job.gpus_per_node=1", "job.ranks_per_node=1", "job.nodes=2"]
    args = [sys.executable, "-m", "hpc", "sbatch-args", "tiny", *(x for s in sets for x in ("--set", s))]
    options = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    assert "--signal=USR1@45" in options and "--time=0-00:25:00" in options and "--partition=urgent" in options
    assert "--gpus-per-node=1" in options and "--nodes=2" in options and "--requeue" in options
    env = {**os.environ, "CONFIG": "tiny", "RUN_DIR": str(tmp_path / "run"), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["sbatch", "--test-only", *options, str(ROOT / "sbatch" / "train.sbatch")],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0 and "to start at" in proc.stderr, proc.stderr
