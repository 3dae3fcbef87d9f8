"""What a launcher does once a launch of the ranks has ended: one pure function of the run directory's records
and the config, used by every launcher (torch-free).

The local launcher (``hpc/submit.py``), the Slurm driver (``hpc/driver.py``) and the sbatch scripts (``python -m
runconfig.decide``, from ``sbatch/common.sh``) all act on the same ``Decision``:

- done: training is complete.
- stopped with a committed checkpoint (a signal): locally the run ends resumable (75). Under Slurm the job is
  requeued for the job's own signal (held instead while the run is paused), up to ``job.max_restarts`` requeues. A
  stop by SIGTERM is Slurm ending the job itself (scancel; scontrol requeue and preemption requeue it themselves),
  so it is not requeued. A job of a chain that is not the last leaves the continuation to the next one.
- failed: bad input (exit status 2, or the trainer's diagnosis says so) ends the run, never retried. Anything else
  (a rank killed or crashed, a collective that failed, a hang the watchdog ended, a start that died in MPI_Init)
  restarts the ranks in the same allocation from the newest valid checkpoint, after a back-off that doubles with
  each restart of the run, up to ``job.max_failures`` restarts per run. Each restart is recorded in history.jsonl
  with its cause (``record_restart``).
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from runconfig.contract import (
    EVENT_RESTART,
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    FAILURE_HANG,
    FAILURE_USER,
    append_event,
)
from runconfig.outcome import Ended, how_it_ended
from runconfig.rundir import RunDir, read_jsonl
from runconfig.schema import JobConfig

Action = Literal["done", "restart", "requeue", "requeuehold", "end"]
MAX_BACKOFF_S = 300.0


@dataclass(frozen=True)
class Situation:
    """What the launcher knows beyond the run directory."""

    slurm: bool  # inside a Slurm job: requeueing is possible
    requeues: int = 0  # SLURM_RESTART_COUNT: how often this job was requeued already
    last_in_chain: bool = True  # false for the earlier jobs of a chain (the next job continues)
    max_requeues: int | None = None  # overrides job.max_restarts (HPC_MAX_RESTARTS of the sbatch scripts)


@dataclass(frozen=True)
class Decision:
    action: Action
    status: int  # the launcher's exit status if it ends here
    message: str  # one line for the job's log
    error: bool = False  # the run ends without completing, and not as a resumable stop the user asked for
    delay_s: float = 0.0  # before a restart
    cause: str = ""  # why the launch failed
    attempt: int = 0  # which in-job restart of the run this is (1, 2, ...)


def restarts_so_far(rundir: RunDir) -> int:
    return sum(1 for e in read_jsonl(rundir.history) if e.get("event") == EVENT_RESTART)


def failure_cause(ended: Ended, failure: dict) -> tuple[str, bool]:
    """(why the launch failed, in one line; whether it was bad input) from failure.json and the exit status."""
    user = failure.get("kind") == FAILURE_USER or ended.status == EXIT_USER_ERROR
    message = str(failure.get("message", "")).strip()
    if message:
        prefix = "hang: " if failure.get("kind") == FAILURE_HANG and not message.startswith("hang") else ""
        rank = failure.get("rank")
        where = f" (found by rank {rank})" if isinstance(rank, int) and f"rank {rank}" not in message else ""
        return f"{prefix}{message}{where}", user
    status = ended.status
    if status < 0 or 128 < status < 128 + 65:  # a signal: Popen's -N, or a shell's / srun's 128 + N
        number = -status if status < 0 else status - 128
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"a rank was killed by {name} (exit status {status}), no diagnosis recorded", user
    return f"the ranks failed with exit status {status}, no diagnosis recorded", user


def decide(rundir: RunDir, job: JobConfig, ended: Ended, situation: Situation) -> Decision:
    if ended.how == "done":
        return Decision("done", EXIT_DONE, f"done: run {rundir.root} complete")
    if ended.how == "stopped":
        return _after_stop(rundir, job, ended, situation)
    cause, user = failure_cause(ended, rundir.failure_record())
    if user:
        return Decision("end", EXIT_USER_ERROR, f"error: {cause}", error=True, cause=cause)
    done_before = restarts_so_far(rundir)
    if done_before >= job.max_failures:
        limit = "restarts are off" if job.max_failures == 0 else f"{done_before} in-job restarts already"
        message = (
            f"error: the ranks failed with exit status {ended.status}; not requeued, not restarted ({limit}: "
            f"job.max_failures={job.max_failures}). Cause: {cause}. Logs in {rundir.logs}; continue with: "
            f"python -m hpc resume {rundir.root}"
        )
        return Decision("end", EXIT_FAILED, message, error=True, cause=cause)
    delay = min(MAX_BACKOFF_S, job.restart_backoff_s * 2**done_before)
    message = (
        f"the launch failed ({cause}); restart {done_before + 1} of at most {job.max_failures} in {delay:g} s from "
        "the newest valid checkpoint"
    )
    return Decision("restart", EXIT_FAILED, message, delay_s=delay, cause=cause, attempt=done_before + 1)


def _after_stop(rundir: RunDir, job: JobConfig, ended: Ended, situation: Situation) -> Decision:
    if not situation.slurm:
        return Decision(
            "end",
            EXIT_STOPPED,
            f"stopped by a signal with a committed checkpoint; continue with: python -m hpc resume {rundir.root}",
        )
    if not situation.last_in_chain:
        return Decision("end", EXIT_DONE, "stopped with a committed checkpoint; the next job of the chain continues")
    if ended.signal == signal.SIGTERM:
        return Decision(
            "end",
            EXIT_STOPPED,
            "stopped by SIGTERM with a committed checkpoint; not requeued (scancel ends the job; scontrol requeue "
            f"and preemption requeue it themselves). Continue a cancelled run with: python -m hpc resume {rundir.root}",
        )
    if rundir.pause_marker.exists():
        return Decision("requeuehold", EXIT_STOPPED, "checkpoint committed; the run is paused (held until released)")
    limit = job.max_restarts if situation.max_requeues is None else situation.max_requeues
    if situation.requeues >= limit:
        return Decision(
            "end",
            EXIT_STOPPED,
            f"error: the run stopped again after {situation.requeues} restarts (job.max_restarts={limit}); not "
            f"requeued. Continue with: python -m hpc resume {rundir.root}",
            error=True,
        )
    return Decision("requeue", EXIT_STOPPED, "checkpoint committed")


def record_restart(rundir: RunDir, decision: Decision, *, failed_launch: str, status: int) -> None:
    """The history event of an in-job restart (written by the launcher, before it waits and restarts)."""
    append_event(
        rundir.history,
        EVENT_RESTART,
        attempt=decision.attempt,
        cause=decision.cause,
        status=status,
        delay_s=decision.delay_s,
        launch=failed_launch,
    )


def main(argv: list[str] | None = None) -> int:
    """For sbatch/common.sh: decide after a launch, record a restart, and print two lines: ``ACTION STATUS
    DELAY_S`` and the message."""
    from runconfig.load import load_config

    parser = argparse.ArgumentParser(prog="python -m runconfig.decide", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("launch_id")
    parser.add_argument("status", type=int, help="the launcher's (srun's) exit status")
    parser.add_argument("--requeues", type=int, default=0, help="SLURM_RESTART_COUNT")
    parser.add_argument("--max-requeues", type=int, default=None, help="overrides job.max_restarts")
    parser.add_argument("--local", action="store_true", help="not in a Slurm job: nothing can be requeued")
    args = parser.parse_args(argv)
    rundir = RunDir(args.run_dir)
    cfg = load_config(str(rundir.config))
    ended = how_it_ended(rundir, args.launch_id, args.status)
    situation = Situation(slurm=not args.local, requeues=args.requeues, max_requeues=args.max_requeues)
    decision = decide(rundir, cfg.job, ended, situation)
    if decision.action == "restart":
        record_restart(rundir, decision, failed_launch=args.launch_id, status=args.status)
    print(decision.action, decision.status, f"{decision.delay_s:g}")
    print(decision.message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
