"""The one restart loop of every launcher (the local one in hpc/submit.py, the Slurm driver in hpc/driver.py):
launch the ranks, decide what follows (hpc/policy/decide.py), and restart in the same allocation while the decision
says so, on the nodes it names, after its back-off."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from hpc.policy.badnodes import Held, retake_how, take_back_due
from hpc.policy.decide import LaunchDecision, Situation, decide_after_launch, record_decision
from hpc.policy.outcome import Ended
from runconfig.schema import JobConfig
from rundir import RunDir


class Launched(Protocol):
    """How one launch of the ranks ended, as its launcher saw it (hpc/local.py's LaunchResult, the driver's)."""

    ended: Ended  # read from the run directory, else the launcher's status (hpc/policy/outcome.py)
    launch_id: str
    nodes: tuple[str, ...]  # the nodes it ran on, in node order
    first_ended: int | None  # the rank whose process the launcher saw end first

    @property
    def status(self) -> int:  # the launcher's exit status (mpirun's, srun's)
        ...


L = TypeVar("L", bound=Launched)


def take_back_due_nodes(rundir: RunDir, job: JobConfig, held: Held | None = None) -> list[str]:
    """Before a launcher chooses its first launch's nodes: the bad nodes due back (job.retake_nodes_after_s) taken
    back, each said in the log (later launches: ``decide_after_launch``)."""
    back = take_back_due(rundir, job.retake_nodes_after_s, held)
    for node in back:
        print(f"bad node {node} taken back ({retake_how(job.retake_nodes_after_s)})", flush=True)
    return back


def until_settled(
    rundir: RunDir,
    job: JobConfig,
    nodes: tuple[str, ...],
    launch: Callable[[tuple[str, ...], int], L],
    situation: Callable[[L], Situation],
) -> tuple[LaunchDecision, L]:
    """``launch(nodes, attempt)`` (attempt 0, 1, ... within this allocation) until a decision other than a restart;
    each decision is recorded in the run's history. ``situation`` tells ``decide_after_launch`` what the launcher
    knows."""
    attempt = 0
    while True:
        launched = launch(nodes, attempt)
        decision = decide_after_launch(rundir, job, launched.ended, situation(launched))
        record_decision(rundir, decision, failed_launch=launched.launch_id, status=launched.status)
        if decision.action != "restart":
            return decision, launched
        # Not the input's fault (a rank killed or crashed, a hang): the ranks restart from the newest checkpoint,
        # without the nodes the failure pointed at.
        print(decision.message, flush=True)
        nodes = decision.use_nodes
        time.sleep(decision.delay_s)
        attempt += 1
