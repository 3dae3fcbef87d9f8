"""What a launcher does once a launch of the ranks has ended: one pure function of the run directory's records
and the config, used by every launcher (the local one and the Slurm driver through hpc/restarts.py, the sbatch
scripts through ``python -m hpc.policy.decide``). Torch-free.

- done: training is complete.
- stopped with a committed checkpoint: locally the run ends resumable (75). Under Slurm the job is requeued for the
  job's own signal (held while the run is paused), up to ``job.max_requeues``; a stop by SIGTERM is Slurm ending
  the job (scancel; requeue and preemption requeue it themselves), so it is not requeued. A job of a chain that is
  not the last leaves the continuation to the next one.
- failed: bad input (status 2, or the trainer's diagnosis says so) ends the run. Anything else (a rank killed or
  crashed, a collective that failed, a hang, a start that died in MPI_Init) restarts the ranks in the allocation
  from the newest valid checkpoint, after a back-off doubling with each restart, up to ``job.max_failures``; each
  restart is a history event with its cause (``record_decision``).
- bad nodes: the nodes a failure points at (failure.json's suspects, else the rank whose process the launcher saw
  end first) are named bad (hpc/policy/badnodes.py) and no later launch uses them: the restart goes on with the
  nodes left when at least ``job.min_nodes`` remain, else a Slurm run continues in a new job with ``--exclude``
  (``resubmit``: a running job's exclusions cannot change) and a local run ends. A stop that would requeue is
  resubmitted too once the run has bad nodes.
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from hpc.policy.badnodes import bad_nodes, due_back, record_bad_node, recorded, retake_how, suspects_of, take_back
from hpc.policy.outcome import Ended, how_it_ended
from hpc.slurmctl import held_by_slurm
from runconfig.schema import JobConfig
from rundir.contract import (
    EVENT_PRUNED,
    EVENT_RESTART,
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    FAILURE_HANG,
    FAILURE_USER,
    append_event,
)
from rundir.paths import RunDir, read_jsonl

Action = Literal["done", "restart", "requeue", "requeuehold", "resubmit", "end"]
MAX_BACKOFF_S = 300.0


@dataclass(frozen=True)
class Situation:
    """What the launcher knows beyond the run directory."""

    slurm: bool  # inside a Slurm job: requeueing is possible
    ending: bool = False  # Slurm is ending the job (SIGTERM to the launcher): no restart, no new job
    requeues: int = 0  # SLURM_RESTART_COUNT: how often this job was requeued already
    last_in_chain: bool = True  # false for the earlier jobs of a chain (the next job continues)
    max_requeues: int | None = None  # overrides job.max_requeues (HPC_MAX_REQUEUES of the sbatch scripts)
    nodes: tuple[str, ...] = ()  # the nodes the launcher may use (the allocation's; locally the simulated ones)
    launch_nodes: tuple[str, ...] = ()  # the nodes the launch that ended ran on, in node order
    first_ended: int | None = None  # the rank whose process the launcher saw end first (its own evidence)
    ranks_per_node: int = 1  # of the launch that ended (maps first_ended to its node)
    failed_nodes: tuple[str, ...] = ()  # nodes the scheduler declared failed during the launch (srun's evidence)
    stop_signal: bool = False  # the launcher got the job's stop signal (SIGUSR1/USR2) while the ranks ran


@dataclass(frozen=True)
class LaunchDecision:
    action: Action
    status: int  # the launcher's exit status if it ends here
    message: str  # one line for the job's log
    error: bool = False  # the run ends without completing, and not as a resumable stop the user asked for
    delay_s: float = 0.0  # before a restart
    cause: str = ""  # why the launch failed
    attempt: int = 0  # which in-job restart of the run this is (1, 2, ...)
    new_bad: tuple[tuple[str, str], ...] = ()  # (node, evidence) named bad by this decision
    use_nodes: tuple[str, ...] = ()  # restart: the nodes of the next launch; resubmit: []
    exclude: tuple[str, ...] = ()  # every bad node of the run (resubmit: the new job's --exclude)
    taken_back: tuple[tuple[str, str, float], ...] = ()  # (node, how, seconds since named): due back


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


def named_nodes(failure: dict, situation: Situation) -> list[tuple[str, str]]:
    """(node, evidence) the failure points at: failure.json's suspects and the nodes the scheduler declared failed,
    else the rank that ended first (srun kills the others of a failed node's step: the first of them is not it)."""
    out = {}
    for suspect in suspects_of(failure):
        why = str(suspect.get("why") or failure.get("message") or "named by the trainer's diagnosis")
        out.setdefault(suspect["node"], f"rank {suspect.get('rank')}: {why}")
    for node in situation.failed_nodes:
        out.setdefault(node, "Slurm declared the node failed during the launch (srun: Node failure)")
    rank = situation.first_ended
    if not out and rank is not None and situation.launch_nodes:
        per_node = max(1, situation.ranks_per_node)
        index = rank // per_node
        if 0 <= index < len(situation.launch_nodes):
            node = situation.launch_nodes[index]
            out[node] = f"rank {rank}'s process ended first (the others were ended after it)"
    return list(out.items())


def _excluding(job: JobConfig, situation: Situation) -> bool:
    """Whether a failure's node is left out. Locally the simulated nodes share one host: only when job.min_nodes
    lets the run go on without one (elastic runs are tried out locally this way)."""
    return job.exclude_bad_nodes and (situation.slurm or job.min_nodes_or_all < job.nodes)


def decide_after_launch(rundir: RunDir, job: JobConfig, ended: Ended, situation: Situation) -> LaunchDecision:
    # Bad nodes due back (job.retake_nodes_after_s) are not bad for this decision; record_decision takes them back.
    held = held_by_slurm if situation.slurm else None
    back = due_back(rundir, job.retake_nodes_after_s, held) if ended.how != "done" else {}
    bad = tuple(n for n in bad_nodes(rundir) if n not in back)
    decision = _decide(rundir, job, ended, situation, bad)
    if not back:
        return decision
    how = retake_how(job.retake_nodes_after_s)
    taken_back = tuple((node, how, age) for node, age in back.items())
    message = f"{decision.message}; node(s) {', '.join(back)} taken back ({how})"
    return replace(decision, taken_back=taken_back, message=message)


def _decide(rundir: RunDir, job: JobConfig, ended: Ended, situation: Situation, bad: tuple[str, ...]) -> LaunchDecision:
    if ended.how == "done":
        pruned = [e for e in read_jsonl(rundir.history) if e.get("event") == EVENT_PRUNED]
        if pruned:  # a sweep element judged at a rung: ended for good, its checkpoint kept
            return LaunchDecision("done", EXIT_DONE, f"pruned: run {rundir.root} at step {pruned[-1].get('step')} "
                            f"({pruned[-1].get('why', 'prune.*')})")  # fmt: skip
        return LaunchDecision("done", EXIT_DONE, f"done: run {rundir.root} complete")
    if ended.how == "stopped":
        return _after_stop(rundir, job, ended, situation, bad)
    return _after_failure(rundir, job, ended, situation, bad)


def _after_failure(
    rundir: RunDir, job: JobConfig, ended: Ended, situation: Situation, bad: tuple[str, ...]
) -> LaunchDecision:
    failure = rundir.failure_record()
    cause, user = failure_cause(ended, failure)
    if user:
        return LaunchDecision("end", EXIT_USER_ERROR, f"error: {cause}", error=True, cause=cause)
    if not suspects_of(failure) and stopped_by_signal(ended, situation, job):
        # The stop signal killed a rank before its handler was installed (interpreter start-up) or after it was
        # restored: a stop without a checkpoint at it, not evidence against the rank's node.
        return _after_stop(rundir, job, ended, situation, bad, committed=False)
    if situation.ending:  # the ranks were ended with the job (scancel, time limit): no node to blame
        message = (
            f"error: the ranks failed with exit status {ended.status} while Slurm was ending the job; not restarted. "
            f"Continue with: python -m hpc resume {rundir.root}"
        )
        return LaunchDecision("end", EXIT_FAILED, message, error=True, cause=cause)
    done_before = restarts_so_far(rundir)
    new_bad = tuple(
        (node, evidence)
        for node, evidence in (named_nodes(failure, situation) if _excluding(job, situation) else [])
        if node not in bad
    )
    exclude = tuple(dict.fromkeys([*bad, *(node for node, _ in new_bad)]))
    named = f"; node(s) {', '.join(n for n, _ in new_bad)} left out from now on" if new_bad else ""
    if done_before >= job.max_failures:
        limit = "restarts are off" if job.max_failures == 0 else f"{done_before} in-job restarts already"
        message = (
            f"error: the ranks failed with exit status {ended.status}; not requeued, not restarted ({limit}: "
            f"job.max_failures={job.max_failures}). Cause: {cause}{named}. Logs in {rundir.logs}; continue with: "
            f"python -m hpc resume {rundir.root}"
        )
        return LaunchDecision("end", EXIT_FAILED, message, error=True, cause=cause, new_bad=new_bad, exclude=exclude)
    return _restart(rundir, job, ended, situation, done_before, f"{cause}){named}", cause, new_bad, exclude)


def _restart(
    rundir: RunDir,
    job: JobConfig,
    ended: Ended,
    situation: Situation,
    done_before: int,
    why: str,
    cause: str,
    new_bad: tuple[tuple[str, str], ...],
    exclude: tuple[str, ...],
) -> LaunchDecision:
    """A restart in the allocation where enough nodes are left; else a new job (Slurm) or the end (locally).
    ``why``: the cause and the nodes named, for the messages."""
    delay = min(MAX_BACKOFF_S, job.restart_backoff_s * 2**done_before)
    usable = tuple(n for n in situation.nodes if n not in exclude)[: job.nodes]
    attempt = done_before + 1
    common = dict(cause=cause, attempt=attempt, new_bad=new_bad, exclude=exclude)
    if not situation.nodes or len(usable) >= job.min_nodes_or_all:
        shrink = (
            f" on {len(usable)} of {job.nodes} nodes ({', '.join(usable)})"
            if situation.nodes and len(usable) < job.nodes
            else ""
        )
        message = (
            f"the launch failed ({why}; restart {attempt} of at most {job.max_failures} in {delay:g} s "
            f"from the newest valid checkpoint{shrink}"
        )
        return LaunchDecision("restart", EXIT_FAILED, message, delay_s=delay, use_nodes=usable, **common)
    left = f"{len(usable)} usable node(s) left, job.min_nodes={job.min_nodes_or_all}"
    if situation.slurm:
        message = (
            f"the launch failed ({why}; {left}: the run continues in a new job that excludes "
            f"{', '.join(exclude)} (restart {attempt} of at most {job.max_failures})"
        )
        return LaunchDecision("resubmit", EXIT_FAILED, message, **common)
    message = (
        f"error: the ranks failed with exit status {ended.status} ({why}; {left}, so the run cannot "
        f"continue here. Continue with: python -m hpc resume {rundir.root}"
    )
    return LaunchDecision("end", EXIT_FAILED, message, error=True, cause=cause, new_bad=new_bad, exclude=exclude)


def stopped_by_signal(ended: Ended, situation: Situation, job: JobConfig) -> bool:
    """A failed launch that the job's stop signal ended: the launcher got it during the launch, or the exit status
    is that signal's (SIGTERM is Slurm ending the job: ``situation.ending``)."""
    status = ended.status
    number = -status if status < 0 else status - 128 if 128 < status < 128 + 65 else 0
    signals = {signal.SIGUSR1, signal.SIGUSR2, getattr(signal, job.signal, signal.SIGUSR2)} - {signal.SIGTERM}
    return situation.stop_signal or number in signals


def _after_stop(
    rundir: RunDir, job: JobConfig, ended: Ended, situation: Situation, bad: tuple[str, ...], committed: bool = True
) -> LaunchDecision:
    done = (
        "with a committed checkpoint"
        if committed
        else "before a rank could handle it (no checkpoint at this stop: the newest valid one is resumed)"
    )
    head = "checkpoint committed" if committed else f"stopped by a signal {done}"
    if not situation.slurm:
        return LaunchDecision(
            "end",
            EXIT_STOPPED,
            f"stopped by a signal {done}; continue with: python -m hpc resume {rundir.root}",
        )
    if not situation.last_in_chain:
        return LaunchDecision("end", EXIT_DONE, f"stopped by a signal {done}; the next job of the chain continues")
    if ended.signal == signal.SIGTERM:
        return LaunchDecision(
            "end",
            EXIT_STOPPED,
            f"stopped by SIGTERM {done}; not requeued (scancel ends the job; scontrol requeue "
            f"and preemption requeue it themselves). Continue a cancelled run with: python -m hpc resume {rundir.root}",
        )
    if rundir.pause_marker.exists():
        return LaunchDecision("requeuehold", EXIT_STOPPED, f"{head}; the run is paused (held until released)")
    limit = job.max_requeues if situation.max_requeues is None else situation.max_requeues
    if situation.requeues >= limit:
        return LaunchDecision(
            "end",
            EXIT_STOPPED,
            f"error: the run stopped again after {situation.requeues} requeues (job.max_requeues={limit}); not "
            f"requeued. Continue with: python -m hpc resume {rundir.root}",
            error=True,
        )
    exclude = bad
    if exclude:  # a requeued job keeps its node exclusions: a new job is submitted with them instead
        return LaunchDecision(
            "resubmit",
            EXIT_STOPPED,
            f"{head}; the run continues in a new job that excludes its bad node(s) {', '.join(exclude)}",
            exclude=exclude,
        )
    return LaunchDecision("requeue", EXIT_STOPPED, head)


def record_decision(rundir: RunDir, decision: LaunchDecision, *, failed_launch: str, status: int) -> None:
    """What a decision names, in history.jsonl (written by the launcher before it acts): each new bad node with
    its evidence, the nodes taken back, and for a restart (in the job or in a resubmitted one) the restart event
    with its cause."""
    for node, how, age in decision.taken_back:
        take_back(rundir, node, how=how, named_s_ago=round(age, 1))
    known = recorded(rundir)
    for node, evidence in decision.new_bad:
        record_bad_node(rundir, node, reason=decision.cause, evidence=evidence, launch=failed_launch, known=known)
    if decision.action in ("restart", "resubmit") and decision.attempt:
        append_event(
            rundir.history,
            EVENT_RESTART,
            attempt=decision.attempt,
            cause=decision.cause,
            status=status,
            delay_s=decision.delay_s,
            launch=failed_launch,
            how="in-job" if decision.action == "restart" else "new job",
            nodes=list(decision.use_nodes),
            excluded=list(decision.exclude),
        )


def main(argv: list[str] | None = None) -> int:
    """For sbatch/common.sh: decide after a launch, record what the decision names, and print four lines:
    ``ACTION STATUS DELAY_S``, the message, the nodes of the next launch and the run's bad nodes (comma-separated,
    "-" for none)."""
    from runconfig.load import load_config

    parser = argparse.ArgumentParser(prog="python -m hpc.policy.decide", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("launch_id")
    parser.add_argument("status", type=int, help="the launcher's (srun's) exit status")
    parser.add_argument("--requeues", type=int, default=0, help="SLURM_RESTART_COUNT")
    parser.add_argument("--max-requeues", type=int, default=None, help="overrides job.max_requeues")
    parser.add_argument("--local", action="store_true", help="not in a Slurm job: nothing can be requeued")
    parser.add_argument("--nodes", default="", help="the allocation's nodes, comma-separated")
    parser.add_argument("--launch-nodes", default="", help="the nodes the launch ran on, in node order")
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--first-ended", type=int, default=None, help="the rank whose task ended first")
    parser.add_argument("--failed-nodes", default="", help="nodes srun reported failed (Node failure on N)")
    parser.add_argument("--stop-signal", action="store_true", help="the launcher got the job's stop signal")
    args = parser.parse_args(argv)
    rundir = RunDir(args.run_dir)
    cfg = load_config(str(rundir.config))
    ended = how_it_ended(rundir, args.launch_id, args.status)
    situation = Situation(
        slurm=not args.local,
        requeues=args.requeues,
        max_requeues=args.max_requeues,
        nodes=split_nodes(args.nodes),
        launch_nodes=split_nodes(args.launch_nodes),
        ranks_per_node=args.ranks_per_node,
        first_ended=args.first_ended,
        failed_nodes=split_nodes(args.failed_nodes),
        stop_signal=args.stop_signal,
    )
    decision = decide_after_launch(rundir, cfg.job, ended, situation)
    record_decision(rundir, decision, failed_launch=args.launch_id, status=args.status)
    print(decision.action, decision.status, f"{decision.delay_s:g}")
    print(decision.message)
    print(",".join(decision.use_nodes) or "-")
    print(",".join(decision.exclude) or "-")
    return 0


def split_nodes(text: str) -> tuple[str, ...]:
    return tuple(n for n in (part.strip() for part in text.split(",")) if n and n != "-")


if __name__ == "__main__":
    sys.exit(main())
