"""The process a Slurm job runs (once, in the batch step): start the ranks, then finish, requeue or give up.

submitit pickles a ``Driver`` and calls it on the first node of the allocation. The ranks are one ``srun`` step
(``srun --mpi=PLUGIN python -m trainer``), so the scheduler's signal (sent to job steps, not the batch shell)
reaches every rank, and the trainer stops at a step boundary with a committed checkpoint and exit status 75.
Only then does the driver requeue the job, and only for the job's own signal: a stop by SIGTERM is Slurm ending
the job (scancel must stay cancelled; scontrol requeue and preemption requeue it themselves). How the launch ended
is read from the run directory (runconfig/outcome.py), not from srun's status alone. A cap on requeues stops
endless loops. A launch that failed through no fault of the input (a rank killed or crashed, a hang) is restarted
in the allocation, up to job.max_failures times per run; what follows every launch is runconfig/decide.py's
decision, the same for every launcher. A job of a chain whose run is already complete ends at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpc.local import trainer_command, trainer_environment
from hpc.mpi import find_launcher
from runconfig import RunConfig, RunDir, load_config
from runconfig.contract import EXIT_DONE, EXIT_STOPPED
from runconfig.decide import Situation, decide, record_restart
from runconfig.outcome import how_it_ended, new_launch_id

PLUGIN_FOR_FLAVOUR = {"mpich": "pmi2", "openmpi": "pmix"}


@dataclass(frozen=True)
class SlurmJob:
    """The SLURM_* variables the driver needs, read in one place."""

    job_id: str
    restart_count: int
    num_nodes: int = 1

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> SlurmJob:
        environ = dict(os.environ if environ is None else environ)
        restart = environ.get("SLURM_RESTART_COUNT", "")  # unset on the first run, not 0
        nodes = environ.get("SLURM_JOB_NUM_NODES", "")
        return cls(
            job_id=environ.get("SLURM_JOB_ID", ""),
            restart_count=int(restart) if restart.isdigit() else 0,
            num_nodes=int(nodes) if nodes.isdigit() else 1,
        )


def mpi_plugin(cfg: RunConfig) -> str:
    if cfg.job.mpi != "auto":
        return cfg.job.mpi
    return PLUGIN_FOR_FLAVOUR[find_launcher().flavour]


def srun_command(cfg: RunConfig, rundir: RunDir) -> list[str]:
    return [
        "srun",
        f"--mpi={mpi_plugin(cfg)}",
        "--kill-on-bad-exit=1",
        f"--ntasks-per-node={cfg.job.ranks_per_node}",
        *cfg.job.srun_args,
        *trainer_command(rundir),
    ]


def sweep_command(num_nodes: int) -> list[str]:
    """One task per node of the allocation removing the shared-memory segments killed ranks left
    (runconfig/shm.py); it shares the nodes with whatever still runs there."""
    return [
        "srun",
        "--overlap",
        "--mpi=none",
        f"--nodes={num_nodes}",
        f"--ntasks={num_nodes}",
        "--ntasks-per-node=1",
        sys.executable,
        "-m",
        "runconfig.shm",
    ]


def run_complete(rundir: RunDir, cfg: RunConfig) -> bool:
    try:
        return json.loads(rundir.summary.read_text())["final_step"] >= cfg.train.steps
    except (OSError, ValueError, KeyError, TypeError):
        return False


@dataclass(frozen=True)
class Driver:
    run_dir: str
    last_in_chain: bool = True  # earlier jobs of a chain leave the continuation to the next one

    def __call__(self) -> dict:
        # submitit's own handlers would checkpoint and requeue from inside a handler: the ranks handle the
        # stop themselves, and a stray signal to the batch step must neither requeue nor kill the driver.
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
        os.umask(0o077)
        rundir = RunDir(Path(self.run_dir))
        cfg = load_config(str(rundir.config))
        job = SlurmJob.from_environ()
        if run_complete(rundir, cfg):
            print(f"run {rundir.root} is already complete; job {job.job_id} ends without work", flush=True)
            return {"status": "complete"}
        command = srun_command(cfg, rundir)
        attempt = 0
        while True:
            suffix = f"-r{attempt}" if attempt else ""
            launch_id = new_launch_id(f"slurm-{job.job_id}.{job.restart_count}{suffix}")
            print(
                f"job {job.job_id} (restart {job.restart_count}, launch {launch_id}): {' '.join(command)}", flush=True
            )
            env = trainer_environment(cfg, simulate_nodes=False, launch_id=launch_id)
            rundir.failure.unlink(missing_ok=True)  # an earlier launch's diagnosis is not this one's
            status = subprocess.call(command, env=env)
            # The run directory says how the launch ended; srun's status alone misreads a stop whose slower ranks
            # were killed by --kill-on-bad-exit while tearing down after the checkpoint was committed.
            ended = how_it_ended(rundir, launch_id, status)
            if ended.recorded and status not in (EXIT_DONE, EXIT_STOPPED):
                print(f"srun exit status {status}, but this launch recorded: {ended.how}", flush=True)
            situation = Situation(slurm=True, requeues=job.restart_count, last_in_chain=self.last_in_chain)
            decision = decide(rundir, cfg.job, ended, situation)
            if decision.action != "restart":
                if ended.how == "failed":
                    # Ranks killed or dead in MPI_Init leave shared memory on their nodes: remove it on every node
                    # (a restarted launch does that itself, on each node, as it starts).
                    self._sweep(cfg, job)
                break
            # In the same allocation, without going back through the queue: the ranks restart from the newest
            # valid checkpoint after the back-off.
            record_restart(rundir, decision, failed_launch=launch_id, status=status)
            print(decision.message, flush=True)
            time.sleep(decision.delay_s)
            attempt += 1
        if decision.action in ("requeue", "requeuehold"):
            print(f"{decision.message}; scontrol {decision.action} {job.job_id}", flush=True)
            # Requeueing from inside the job ends it at once: everything is already committed.
            subprocess.call(["scontrol", decision.action, job.job_id])
            return {"status": decision.action}
        print(decision.message, flush=True)
        if decision.error:
            raise RuntimeError(decision.message.removeprefix("error: "))
        return {"status": ended.how}

    @staticmethod
    def _sweep(cfg: RunConfig, job: SlurmJob) -> None:
        try:
            subprocess.run(sweep_command(job.num_nodes), env=trainer_environment(cfg, simulate_nodes=False), timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"warning: the shared-memory sweep after the failed launch did not finish: {exc}", flush=True)
