"""How one launch of the ranks ended, read from the run directory rather than from a launcher's exit status.

A launcher (``srun``, ``mpirun``) reports one status for all ranks, and it is not reliable at the edges: with
``--kill-on-bad-exit`` the first rank to exit 75 gets the slower ones killed while they are still tearing
down, and srun then reports 137 although every rank had committed the checkpoint. The launcher gives each launch
an id (``HPC_LAUNCH_ID``); rank 0 writes it into every ``history.jsonl`` event, so the launcher can ask what
*this* launch recorded: a completed run, or a stop whose checkpoint is committed.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Literal

from runconfig.checkpoints import latest_committed
from runconfig.rundir import RunDir

#: Environment variable carrying the launch id from the launcher to the ranks.
LAUNCH_VAR = "HPC_LAUNCH_ID"

Outcome = Literal["done", "stopped"]


def new_launch_id(prefix: str = "local") -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def launch_events(rundir: RunDir, launch_id: str) -> list[dict]:
    try:
        lines = rundir.history.read_text().splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut short by a full disk or a kill
        if isinstance(event, dict) and event.get("launch") == launch_id:
            events.append(event)
    return events


def launch_outcome(rundir: RunDir, launch_id: str) -> Outcome | None:
    """ "done" if this launch finished training, "stopped" if it stopped with its checkpoint committed, else None."""
    events = launch_events(rundir, launch_id)
    if any(e.get("event") == "done" for e in events) and rundir.summary.exists():
        return "done"
    stops = [e for e in events if e.get("event") == "stopped"]
    if stops:
        manifest = latest_committed(rundir.checkpoints)
        if manifest is not None and int(manifest.get("step", -1)) >= int(stops[-1].get("step", 0)):
            return "stopped"
    return None


def stop_signal(rundir: RunDir, launch_id: str) -> int | None:
    """The signal number that stopped this launch (the first one a rank received), if it recorded a stop."""
    stops = [e for e in launch_events(rundir, launch_id) if e.get("event") == "stopped"]
    signum = stops[-1].get("signal") if stops else None
    return int(signum) if isinstance(signum, int) else None


def main(argv: list[str] | None = None) -> int:
    """``python -m runconfig.outcome RUN_DIR LAUNCH_ID`` prints "done", "stopped SIGNUM" or "none" (for
    sbatch/common.sh)."""
    import sys
    from pathlib import Path

    run_dir, launch_id = sys.argv[1:] if argv is None else argv
    rundir = RunDir(Path(run_dir))
    outcome = launch_outcome(rundir, launch_id)
    print(f"stopped {stop_signal(rundir, launch_id) or 0}" if outcome == "stopped" else outcome or "none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
