"""Against a REAL Slurm cluster (munge + slurmctld + 2 slurmd from Debian) started by envs/slurm/cluster.sh.

Jobs go through `python -m hpc.submit` exactly as a user's would; preemption is real: the job's signal sent by
scancel, an external `scontrol requeue`, and a job in a higher-priority partition.
"""

import json
import os
import signal
import stat
import subprocess

import pytest

from runconfig import dump_yaml, load_config
from rundir import RunDir
from rundir.checkpoints import read_latest, validate
from rundir.contract import EVENT_RESTART, EVENT_RESUME, EVENT_STOPPED, INJECT_VAR
from tests.conftest import PY, ROOT, history, rank_pids, run_cli, summary
from tests.mp.test_tracking import assert_history_is_metrics_jsonl, client_and_run
from tests.slurm.conftest import TWO_NODES, job_log, rank_nodes, sets_for, submit, wait_state, wait_step

pytestmark = pytest.mark.slurm


def test_two_nodes_two_ranks_each(slurm, small_dataset, reference, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, sets_for(small_dataset))
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    assert info["JobState"] == "COMPLETED", info
    assert summary(run_dir)["params_sha256"] == reference
    assert rank_nodes(run_dir) == {0: "n1", 1: "n1", 2: "n2", 3: "n2"}  # really spread over both nodes, in blocks
    assert (run_dir / f"job_{job_id}.sbatch").read_text().count("#SBATCH --nodes=2") == 1
    for path in (run_dir, run_dir / "slurm", run_dir / "slurm" / job_id):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert [e for e in history(run_dir) if e["event"] == "start"][0]["slurm_job_id"] == job_id


def resumed_bitwise(run_dir, job_id, reference) -> dict:
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
    assert info["JobState"] == "COMPLETED", f"{info}\n{job_log(run_dir, job_id)}"
    assert int(info["Restarts"]) >= 1, info
    events = history(run_dir)
    resumes = [e for e in events if e["event"] == EVENT_RESUME]
    assert resumes and resumes[0]["slurm_restart_count"] >= 1 and resumes[0]["slurm_job_id"] == job_id
    assert summary(run_dir)["params_sha256"] == reference
    ckpts = run_dir / "checkpoints"
    manifest = validate(ckpts / read_latest(ckpts))  # written by the requeued job: it records which one
    assert manifest["slurm_job_id"] == job_id and manifest["slurm_restart_count"] >= 1, manifest
    return info


def test_preempted_by_the_job_signal(slurm, small_dataset, reference_2x1, tmp_path):
    """The requeued job resumes bit-identical, and continues the same MLflow run (embedded, beside the run
    directory): one run, one value per step, tagged with the job and its restart count."""
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, [*sets_for(small_dataset), *TWO_NODES, "tracking.backend=mlflow"])
    wait_step(run_dir, 10)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)  # to the job's steps: every rank
    resumed_bitwise(run_dir, job_id, reference_2x1)
    stopped = [e for e in history(run_dir) if e["event"] == EVENT_STOPPED]
    assert len(stopped) == 1 and stopped[0]["step"] >= 10
    client, run_id, _ = client_and_run(run_dir)
    assert len(client.search_runs([client.get_experiment_by_name("hpc-trainer").experiment_id])) == 1
    assert_history_is_metrics_jsonl(client, run_id, run_dir, steps=60)
    tags = client.get_run(run_id).data.tags
    assert tags["hpc.slurm_job_id"] == job_id and int(tags["hpc.slurm_restart_count"]) >= 1
    assert tags["hpc.launches"] == "2"


def test_requeued_by_scontrol_under_hsdp(slurm, small_dataset, tmp_path):
    """A sharded layout on Slurm: HSDP (FSDP2 shards inside each node, the two nodes replicas). Requeued from
    outside mid-run, the next job resumes from the sharded checkpoint and ends bit-identical to the same layout
    run locally without a stop."""
    sets = [*sets_for(small_dataset), "parallel.dp_shard=2"]
    local = tmp_path / "local"
    proc = run_cli(
        ["-m", "hpc.submit", "tiny", "--local", "--run-dir", str(local), *(a for s in sets for a in ("--set", s))]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary(local)["allreduce"] == "hsdp" and summary(local)["parallel"]["dp_shard"] == 2
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, sets)
    wait_step(run_dir, 10)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    resumed_bitwise(run_dir, job_id, summary(local)["params_sha256"])
    assert summary(run_dir)["allreduce"] == "hsdp"


def test_preempted_by_a_higher_priority_partition(slurm, small_dataset, reference_2x1, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, [*sets_for(small_dataset), *TWO_NODES])
    wait_step(run_dir, 10)
    urgent = subprocess.run(
        ["sbatch", "--parsable", "-p", "urgent", "-N2", "--ntasks-per-node=4", f"--output={tmp_path}/urgent.out",
         "--wrap", "sleep 2"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    wait_state(urgent, {"COMPLETED"}, timeout=180)
    resumed_bitwise(run_dir, job_id, reference_2x1)
    assert any(e["event"] == EVENT_STOPPED for e in history(run_dir))  # the trainer saw the preemption signal


def test_wrong_mpi_plugin_is_detected(slurm, small_dataset, tmp_path):
    """srun without the PMI the MPI library speaks starts N separate worlds of 1: the trainer refuses to train."""
    run_dir = tmp_path / "run"
    rundir = RunDir(run_dir)
    rundir.create()
    rundir.config.write_text(dump_yaml(load_config("tiny", sets_for(small_dataset))))
    out = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=2", "--mpi=none", PY, "-m", "trainer", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode != 0
    assert "Slurm started 4 tasks but MPI sees a world of 1" in out.stdout + out.stderr
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text()


def test_restart_cap_and_real_errors_are_not_requeued(slurm, small_dataset, tmp_path):
    capped = tmp_path / "capped"
    job_id = submit(capped, [*sets_for(small_dataset), *TWO_NODES, "train.steps=400", "job.max_requeues=0"])
    wait_step(capped, 10)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", info
    assert history(capped)[-1]["event"] == EVENT_STOPPED  # the checkpoint was committed; `hpc resume` continues it

    broken = tmp_path / "broken"
    job_id = submit(broken, [*sets_for(small_dataset), *TWO_NODES, f"data.path={tmp_path / 'missing'}"])
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", info
    assert "does not exist" in json.loads((broken / "failure.json").read_text())["message"]


def test_a_vanished_rank_is_named_and_the_job_ends(slurm, small_dataset, tmp_path):
    """Rank 1's process (on n2) ends (status 0) in step 5: srun waits for the other, whose collective fails; it
    names rank 1 by a roll call (it does not answer) and aborts the MPI job instead of hanging in MPI_Finalize."""
    run_dir = tmp_path / "run"
    sets = [*sets_for(small_dataset), *TWO_NODES, "monitor.heartbeat_s=1", "monitor.hang_timeout_s=30"]
    sets += ["job.max_failures=1", "job.restart_backoff_s=1"]  # the fault is injected in every launch
    sets += ["job.exclude_bad_nodes=false"]  # restarted on the same nodes (tests/slurm/test_badnodes.py: elsewhere)
    job_id = submit(run_dir, [*sets, f"job.env={json.dumps({INJECT_VAR: 'exit:1:5'})}"])
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=180)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", f"{info}\n{job_log(run_dir, job_id)}"
    message = json.loads((run_dir / "failure.json").read_text())["message"]
    assert "a collective failed at step 5" in message, message
    assert "rank(s) 1 did not answer within 1 s (ended or frozen)" in message, message
    restarts = [e for e in history(run_dir) if e["event"] == EVENT_RESTART]  # restarted once in the job, then given up
    assert len(restarts) == 1 and "a collective failed at step 5" in restarts[0]["cause"], restarts
    assert "1 in-job restarts already: job.max_failures=1" in job_log(run_dir, job_id)
    log = job_log(run_dir, job_id)  # after the failed launch, one task per node swept its shared memory
    assert "(slurm node n1): removed" in log and "(slurm node n2): removed" in log, log


def test_a_killed_rank_is_restarted_in_the_job(slurm, small_dataset, reference, tmp_path):
    """SIGKILL to one rank of a submitted job, its node not left out (job.exclude_bad_nodes: false): the driver
    restarts the ranks in the same allocation (no requeue) from the newest checkpoint; the run ends bit-identical
    and history names the restart's cause."""
    run_dir = tmp_path / "run"
    # 2 x 2 ranks: a survivor blocked in a collective with ranks that are themselves waiting (not with the dead one,
    # whose closed connection ends its peers' waits at once) stays blocked until srun's SIGTERM
    sets = [*sets_for(small_dataset), "job.restart_backoff_s=0.5", "job.exclude_bad_nodes=false"]
    job_id = submit(run_dir, sets)
    wait_step(run_dir, 12)
    os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{job_log(run_dir, job_id)}"
    events = history(run_dir)
    restarts = [e for e in events if e["event"] == EVENT_RESTART]
    assert len(restarts) == 1 and restarts[0]["status"] != 0, restarts
    resumed = [e for e in events if e["event"] == EVENT_RESUME]
    assert resumed and resumed[-1]["slurm_job_id"] == job_id and resumed[-1]["step"] >= 10, events
    assert resumed[-1]["nodes"] == ["n1", "n2"], resumed
    assert summary(run_dir)["params_sha256"] == reference
    # the survivors, blocked in a collective with the dead rank, ended at srun's SIGTERM, not at KillWait's SIGKILL
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rank_*.log"))
    assert "SIGTERM arrived" in logs and "rather than at the scheduler's SIGKILL" in logs, logs[-3000:]
