"""Running a job on this machine under the pip-installed MPI, nodes simulated on one host."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from hpc.follow import JsonlFollower, Progress, resume_notes
from hpc.mpi import LauncherError, MpiLauncher
from hpc.policy.outcome import Ended, how_it_ended, new_launch_id
from hpc.ranks import RankWatch
from hpc.spares import Spares
from runconfig import RunConfig
from rundir import RunDir
from rundir.contract import EVENT_RESUME, FAILURE_HANG, LAUNCH_VAR, NODE_LABELS_VAR, NODE_WRAP_VAR, SIMULATE_VAR
from rundir.identity import read_identity
from storage import nodememory, shm


def trainer_command(rundir: RunDir, prefix: list[str] | tuple[str, ...] = ()) -> list[str]:
    """One rank's command line; ``prefix`` (job.launch_prefix) goes before the interpreter, e.g. a container."""
    return [*prefix, sys.executable, "-u", "-m", "trainer", "--run-dir", str(rundir.root)]


def rank_variables(cfg: RunConfig, environ: dict[str, str]) -> dict[str, str]:
    """What the config adds to the ranks' environment: job.env, and OMP_NUM_THREADS from job.threads_per_rank
    unless ``environ`` sets it already (the local launcher, the driver and sbatch/common.sh all use this)."""
    out = dict(cfg.job.env)
    if cfg.job.threads_per_rank and "OMP_NUM_THREADS" not in {**environ, **out}:
        out["OMP_NUM_THREADS"] = str(cfg.job.threads_per_rank)
    return out


def trainer_environment(
    cfg: RunConfig, *, simulate_nodes: bool, launch_id: str = "", base: dict[str, str] | None = None
) -> dict:
    """The ranks' environment: nodes simulated on one host (local runs), thread count, launch id, import path."""
    env = dict(os.environ if base is None else base)
    env.update(rank_variables(cfg, env))
    env[LAUNCH_VAR] = launch_id
    if simulate_nodes:
        env[SIMULATE_VAR] = str(cfg.job.ranks_per_node)
    # The ranks' import path never holds the folder they start in (Python 3.11's safe path: a `trainer/` or
    # `torch.py` someone put in a shared submit folder would shadow the real one); the recipe's code comes from the
    # run directory's snapshot. And the repository importable from a checkout without `pip install -e .`.
    env["PYTHONSAFEPATH"] = "1"
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


@dataclass
class LaunchResult:
    ended: Ended  # how the launch ended (hpc/policy/outcome.py): recorded in the run directory, else mpirun's status
    output_tail: list[str]  # the last lines mpirun printed (kept in memory: the log's disk may be full)
    launch_id: str  # HPC_LAUNCH_ID of this launch (its history events carry it)
    nodes: tuple[str, ...] = ()  # the simulated nodes it ran on
    first_ended: int | None = None  # the rank whose process ended first, when one clearly did

    @property
    def status(self) -> int:
        return self.ended.status

    def error_line(self) -> str | None:
        """The trainer's one-paragraph user error, as printed by the reporting rank."""
        for line in reversed(self.output_tail):
            if line.startswith("error: "):
                return line[len("error: ") :]
        return None


def node_wraps(
    cfg: RunConfig, nodes: tuple[str, ...], environ: Mapping[str, str] = os.environ
) -> list[list[str]] | None:
    """The command prefix of each simulated node's ranks from HPC_LOCAL_NODE_WRAP (one per node of the job,
    "|"-separated; benchmarks put each emulated node in a network namespace of its own), None where unset."""
    text = environ.get(NODE_WRAP_VAR)
    if not text:
        return None
    wraps = [shlex.split(part) for part in text.split("|")]
    if len(wraps) != cfg.job.nodes:
        raise LauncherError(
            f"environment variable {NODE_WRAP_VAR} has {len(wraps)} command prefixes separated by '|'; the job has "
            f"{cfg.job.nodes} nodes (one prefix each)."
        )
    return [wraps[simulated_nodes(cfg).index(name)] for name in nodes]


def simulated_nodes(cfg: RunConfig) -> tuple[str, ...]:
    """The names of a local run's simulated nodes (a node left out keeps the others' names)."""
    return tuple(f"node{i}" for i in range(cfg.job.nodes))


def memory_of(cfg: RunConfig, rundir: RunDir) -> tuple[str, str] | None:
    """(checkpoint.memory_dir, the run id) when the run keeps checkpoints in node memory."""
    if not cfg.checkpoint.memory_every_steps:
        return None
    try:
        return cfg.checkpoint.memory_dir, read_identity(rundir.identity).run_id
    except (OSError, ValueError, KeyError):
        return None


def remove_memory_checkpoints(cfg: RunConfig, rundir: RunDir) -> bool:
    """The run's checkpoints in node memory on this host removed (checkpoint.memory_every_steps), once its launcher
    ends; whether there were any."""
    memory = memory_of(cfg, rundir)
    return memory is not None and nodememory.remove_run(*memory)


def run_local(
    cfg: RunConfig,
    rundir: RunDir,
    launcher: MpiLauncher,
    *,
    show_progress: bool = True,
    nodes: tuple[str, ...] | None = None,
) -> LaunchResult:
    """Start the ranks of ``nodes`` simulated nodes (default: all of the job's) with mpirun, follow their
    metrics, and return how it ended."""
    nodes = simulated_nodes(cfg) if nodes is None else nodes
    world_size = len(nodes) * cfg.job.ranks_per_node
    if cfg.job.spare_ranks:  # the ranks are no MPI processes: hydra would end them all at a second death
        command = [
            sys.executable,
            "-m",
            "hpc.spawn",
            str(world_size),
            "--",
            *trainer_command(rundir, cfg.job.launch_prefix),
        ]
    else:
        command = launcher.command(world_size, trainer_command(rundir, cfg.job.launch_prefix), node_wraps(cfg, nodes))
    rundir.clear_failure()  # from an earlier attempt of this run directory
    launch_id = new_launch_id()
    metrics = JsonlFollower(rundir.metrics, launch=launch_id)  # this launch's steps only, not a resumed run's
    events = JsonlFollower(rundir.history, launch=launch_id)
    progress = Progress(cfg.train.steps) if show_progress else None
    tail_lines: deque[str] = deque(maxlen=200)
    env = trainer_environment(cfg, simulate_nodes=True, launch_id=launch_id)
    env[NODE_LABELS_VAR] = ",".join(nodes)
    spare_command = trainer_command(rundir, cfg.job.launch_prefix)
    spares = Spares(cfg, rundir, env, world_size, [["", spare_command]]) if cfg.job.spare_ranks else None
    try:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, errors="replace"
        )
    except BaseException:
        if spares is not None:
            spares.kill()
        raise
    # The survivors of a rank that died name it by a roll call (1-5 s, trainer/observe/watchdog.py) and abort;
    # ranks still running well after that (blocked in MPI), or after the failure is on record, are killed. With
    # spares the survivors go on in a new generation: only a failure on record ends them.
    grace = float("inf") if spares is not None else 4 * cfg.monitor.heartbeat_s + 20
    watch = RankWatch(proc.pid, world_size, grace_s=grace, settled=partial(settle_s, rundir))
    copier = threading.Thread(target=_copy_output, args=(proc, rundir.launcher_log, command, tail_lines), daemon=True)
    copier.start()
    try:
        while proc.poll() is None:
            time.sleep(0.25)
            _show(events, metrics, progress)
            if progress:
                progress.tick()
        _show(events, metrics, progress)
        if spares is not None:
            spares.finish()
    except KeyboardInterrupt:  # the ranks stop first (spares that took a place got the Ctrl-C too), then the keeper
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        if spares is not None:
            spares.finish(timeout_s=30)
        raise
    finally:
        if progress:
            progress.close()
        copier.join(timeout=10)
        watch.close()
        if spares is not None:
            spares.kill()
        # Ranks killed during MPI start-up leave their shared-memory segments; the launch removes them.
        shm.sweep()
    ended = how_it_ended(rundir, launch_id, proc.returncode)
    return LaunchResult(ended, list(tail_lines), launch_id, nodes, watch.first_ended)


def _show(events: JsonlFollower, metrics: JsonlFollower, progress: Progress | None) -> None:
    """What the launch wrote since the last look: a resume's warnings (before any step of it), then its steps."""
    for event in events.poll():
        if event.get("event") == EVENT_RESUME:
            for note in resume_notes(event):
                print(note, flush=True)
    for record in metrics.poll():
        if progress:
            progress.update(record)


#: After a hang's report, the seconds the ranks still running get before they are killed: the live ones end right
#: after the report (trainer/observe/watchdog.py), what is left is hung (frozen, or stuck without its watchdog).
HANG_SETTLE_S = 3.0


def settle_s(rundir: RunDir) -> float | None:
    """For RankWatch: None until the launch's failure is on record, then how long the rest get to end themselves."""
    if not rundir.failure.exists():
        return None
    return HANG_SETTLE_S if rundir.failure_record().get("kind") == FAILURE_HANG else RankWatch.SETTLE_S


def _copy_output(proc: subprocess.Popen, path: Path, command: list[str], tail_lines: deque[str]) -> None:
    """mpirun's output -> logs/mpirun.log, keeping the last lines in memory; a full disk loses the file only."""
    log = None
    with contextlib.suppress(OSError):
        log = open(path, "a")  # noqa: SIM115 (closed below)
        log.write(f"$ {' '.join(command)}\n")
    for line in proc.stdout:
        tail_lines.append(line.rstrip("\n"))
        if log is not None:
            try:
                log.write(line)
                log.flush()
            except OSError:
                log = None
    if log is not None:
        with contextlib.suppress(OSError):
            log.close()
