"""How one launch of the ranks ended, read from the run directory rather than from a launcher's exit status.

A launcher (``srun``, ``mpirun``) reports one status for all ranks, and it is not reliable at the edges: with
``--kill-on-bad-exit`` the first rank to exit 75 gets the slower ones killed while they are still tearing
down, and srun then reports 137 although every rank had committed the checkpoint. The launcher gives each launch
an id (``HPC_LAUNCH_ID``); rank 0 writes it into every ``history.jsonl`` event, so the launcher can ask what
*this* launch recorded: a completed run, or a stop whose checkpoint is committed.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Literal

from rundir.checkpoints import latest_committed
from rundir.contract import EVENT_DONE, EVENT_PRUNED, EVENT_STOPPED, EXIT_DONE, EXIT_STOPPED
from rundir.paths import RunDir, read_jsonl

Outcome = Literal["done", "stopped"]


@dataclass(frozen=True)
class Ended:
    """How a launch ended: what it recorded, else what the launcher's exit status says."""

    how: Literal["done", "stopped", "failed"]
    status: int  # the launcher's exit status
    signal: int | None = None  # the first signal a rank got, for a recorded stop
    recorded: bool = False  # confirmed by the run directory (not only by the exit status)


def new_launch_id(prefix: str = "local") -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def launch_events(rundir: RunDir, launch_id: str) -> list[dict]:
    return [e for e in read_jsonl(rundir.history) if e.get("launch") == launch_id]


def _recorded(rundir: RunDir, events: list[dict]) -> Outcome | None:
    if any(e.get("event") in (EVENT_DONE, EVENT_PRUNED) for e in events) and rundir.summary.exists():
        return "done"  # a pruned sweep element ended for good too
    stops = [e for e in events if e.get("event") == EVENT_STOPPED]
    if stops:
        manifest = latest_committed(rundir.checkpoints)
        if manifest is not None and int(manifest.get("step", -1)) >= int(stops[-1].get("step", 0)):
            return "stopped"
    return None


def launch_outcome(rundir: RunDir, launch_id: str) -> Outcome | None:
    """ "done" if this launch finished training, "stopped" if it stopped with its checkpoint committed, else None."""
    return _recorded(rundir, launch_events(rundir, launch_id))


def how_it_ended(rundir: RunDir, launch_id: str, status: int) -> Ended:
    """The launch's recorded outcome where there is one (it overrides the status: see the module docstring),
    else the status: 0 done, EXIT_STOPPED stopped, anything else failed."""
    events = launch_events(rundir, launch_id)
    recorded = _recorded(rundir, events)
    if recorded == "done":
        return Ended("done", status, recorded=True)
    if recorded == "stopped":
        signum = [e for e in events if e.get("event") == EVENT_STOPPED][-1].get("signal")
        return Ended("stopped", status, signum if isinstance(signum, int) else None, recorded=True)
    how = "done" if status == EXIT_DONE else "stopped" if status == EXIT_STOPPED else "failed"
    return Ended(how, status)


def main(argv: list[str] | None = None) -> int:
    """``python -m hpc.policy.outcome RUN_DIR LAUNCH_ID STATUS`` prints how the launch ended and the stop signal
    (0 when none): "done 0", "stopped 15", "failed 0" (for sbatch/common.sh)."""
    import sys
    from pathlib import Path

    run_dir, launch_id, status = sys.argv[1:] if argv is None else argv
    ended = how_it_ended(RunDir(Path(run_dir)), launch_id, int(status))
    print(ended.how, ended.signal or 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
