"""What Slurm says about a run's jobs (torch-free): job ids from RUN_DIR/jobs.jsonl, state from scontrol, and
from sacct when accounting (slurmdbd) is there."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from rundir import RunDir
from rundir.paths import read_jsonl

FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # RUNNING, PENDING, COMPLETED, ... or UNKNOWN when Slurm no longer knows the job
    reason: str = ""  # scontrol's or sacct's Reason; for UNKNOWN, why neither knows the job
    restarts: int = 0
    source: str = "scontrol"  # where the state comes from: scontrol, sacct, or "" (UNKNOWN)

    @property
    def finished(self) -> bool:
        return self.state in FINISHED or self.state == "UNKNOWN"

    @property
    def held(self) -> bool:
        """Held, so ``scontrol release`` lets it run. scontrol hold: Reason=JobHeldUser/JobHeldAdmin; requeuehold:
        Reason=job_requeued_in_held_state, which a job that requeue-held itself (the driver's pause) shows while
        still COMPLETING, before PENDING. A release in that window is taken (rc 0) and the job goes PENDING
        (BeginTime) and runs, so any unfinished, not-running job whose reason says held counts
        (docs/measurements/notes-login-side.md)."""
        return self.state not in ("RUNNING", *FINISHED, "UNKNOWN") and "held" in self.reason.lower()


def job_ids(rundir: RunDir) -> list[str]:
    return [str(j["job_id"]) for j in read_jsonl(rundir.jobs) if "job_id" in j]


def query(job_id: str) -> JobState:
    """scontrol while the controller remembers the job (MinJobAge, default 300 s, after it ended); then sacct if
    accounting (slurmdbd) has it; else UNKNOWN, with the reason."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
        return JobState(
            job_id, fields.get("JobState", "UNKNOWN"), fields.get("Reason", ""), int(fields.get("Restarts", 0))
        )
    error = _last_line(out.stderr or out.stdout)
    why = (
        "the controller no longer knows it (it forgets finished jobs MinJobAge after they end)"
        if "invalid job id" in error.lower()
        else f"scontrol: {error or 'no answer'}"
    )
    if not shutil.which("sacct"):
        return JobState(job_id, "UNKNOWN", f"{why}, and sacct (accounting) is not installed", source="")
    # -D: one line per run of the job (requeues included), the last is the current one. -X: the job, not its steps.
    acct = subprocess.run(
        ["sacct", "-n", "-X", "-D", "-P", "-j", job_id, "-o", "State,Reason"], capture_output=True, text=True
    )
    lines = [line for line in acct.stdout.splitlines() if line.strip()]
    if acct.returncode == 0 and lines:
        state, _, reason = lines[-1].partition("|")
        # "CANCELLED by 0" -> CANCELLED, the rest goes to the reason
        state, _, by = state.strip().partition(" ")
        reason = " ".join(x for x in (by, "" if reason == "None" else reason) if x)
        return JobState(job_id, state or "UNKNOWN", reason, len(lines) - 1, source="sacct")
    if acct.returncode == 0:
        return JobState(job_id, "UNKNOWN", f"{why}, and accounting (sacct) has no record of it", source="")
    return JobState(job_id, "UNKNOWN", f"{why}, and sacct: {_last_line(acct.stderr or acct.stdout)}", source="")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run(args: list[str]) -> str:
    """Run a Slurm command; its error output becomes the exception's message."""
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {(out.stderr or out.stdout).strip()}")
    return out.stdout
