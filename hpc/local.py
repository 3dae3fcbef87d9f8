"""Running a job on this machine under the pip-installed MPI, nodes simulated on one host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hpc.mpi import MpiLauncher
from hpc.progress import MetricsFollower, Progress
from runconfig import RunConfig, RunDir

#: Environment variable the trainer reads to lay one host's ranks out as simulated nodes (trainer/env.py).
SIMULATE_VAR = "HPC_SIMULATE_RANKS_PER_NODE"


def trainer_command(rundir: RunDir) -> list[str]:
    return [sys.executable, "-u", "-m", "trainer", "--run-dir", str(rundir.root)]


def local_environment(cfg: RunConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env[SIMULATE_VAR] = str(cfg.job.ranks_per_node)
    if cfg.job.threads_per_rank and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(cfg.job.threads_per_rank)
    # Make the repository importable when running from a checkout without `pip install -e .`.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def run_local(cfg: RunConfig, rundir: RunDir, launcher: MpiLauncher, *, show_progress: bool = True) -> int:
    """Start ``world_size`` ranks with mpirun, follow their metrics, and return the launcher's exit status."""
    command = launcher.command(cfg.job.world_size, trainer_command(rundir))
    rundir.failure.unlink(missing_ok=True)  # from an earlier attempt of this run directory
    log_path = rundir.logs / "mpirun.log"
    follower = MetricsFollower(rundir.metrics)
    progress = Progress(cfg.train.steps) if show_progress else None
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=local_environment(cfg))
        try:
            while proc.poll() is None:
                time.sleep(0.25)
                for record in follower.poll():
                    if progress:
                        progress.update(record)
            for record in follower.poll():
                if progress:
                    progress.update(record)
        except KeyboardInterrupt:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        finally:
            if progress:
                progress.close()
    return proc.returncode


def read_failure(rundir: RunDir) -> str | None:
    try:
        data = json.loads(rundir.failure.read_text())
        return str(data["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
