"""What Slurm says about a run's jobs (torch-free): job ids from RUN_DIR/jobs.jsonl, state from scontrol, and
from sacct when accounting (slurmdbd) is there."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass

from runconfig import RunDir

FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # RUNNING, PENDING, COMPLETED, ... or UNKNOWN when Slurm no longer knows the job
    reason: str = ""
    restarts: int = 0

    @property
    def finished(self) -> bool:
        return self.state in FINISHED or self.state == "UNKNOWN"

    @property
    def held(self) -> bool:
        # scontrol hold: Reason=JobHeldUser/JobHeldAdmin; requeuehold: Reason=job_requeued_in_held_state
        return self.state in ("PENDING", "REQUEUE_HOLD") and "held" in self.reason.lower()


def job_ids(rundir: RunDir) -> list[str]:
    try:
        lines = rundir.jobs.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [str(json.loads(line)["job_id"]) for line in lines if line.strip()]


def query(job_id: str) -> JobState:
    """scontrol while the controller remembers the job; else sacct if accounting exists; else UNKNOWN."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
        return JobState(
            job_id, fields.get("JobState", "UNKNOWN"), fields.get("Reason", ""), int(fields.get("Restarts", 0))
        )
    if shutil.which("sacct"):
        acct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True)
        state = acct.stdout.strip().split("\n")[-1].split()[0] if acct.returncode == 0 and acct.stdout.strip() else ""
        if state:
            return JobState(job_id, state)
    return JobState(job_id, "UNKNOWN")


def run(args: list[str]) -> str:
    """Run a Slurm command; its error output becomes the exception's message."""
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {(out.stderr or out.stdout).strip()}")
    return out.stdout
