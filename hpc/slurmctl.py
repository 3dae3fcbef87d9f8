"""The one door to Slurm's commands (torch-free): scontrol, squeue, sacct, scancel, and sbatch
outside submitit (the plain sbatch scripts' continuation job; hpc/slurm.py submits through submitit).

One error policy: a command that changes something raises ``SlurmError`` naming the command and Slurm's answer
(callers that can go on catch it and warn); a query never raises, it says UNKNOWN and why. One parser for
scontrol's one-line records. Job states are asked for in batches: one squeue call for any number of jobs, then one
sacct call for those the controller no longer remembers (as submitit's watcher does).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rundir.slurmvars import slurm_conf, slurm_job_nodes

#: node states (scontrol's State=, '+'-separated) in which Slurm holds a node failed
FAILED_STATES = {"DOWN", "FAIL", "FAILING", "NOT_RESPONDING"}
#: ... or taken out of service by an operator
DRAINED_STATES = {"DRAIN", "DRAINED", "DRAINING", "MAINTENANCE", "REBOOT_REQUESTED", "REBOOT_ISSUED"}
#: job states after which a job runs no more
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
QUERY_TIMEOUT_S = 60.0
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=(.*?)(?=\s+[A-Za-z][\w:/]*=|\s*$)")


class SlurmError(RuntimeError):
    """A Slurm command that was to change something failed; the message names the command and Slurm's answer."""


def available(environ: Mapping[str, str] = os.environ) -> bool:
    """Slurm is the target when sbatch is on PATH and a cluster config is there (installed client packages alone,
    as on a machine that ran the tests, do not count)."""
    return shutil.which("sbatch") is not None and slurm_conf(environ).is_file()


def _call(args: list[str], env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, check=False, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(args, 127, "", str(exc))


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run(args: list[str]) -> str:
    """Run a Slurm command that changes something; its output, or ``SlurmError`` with its error output."""
    out = _call(args)
    if out.returncode != 0:
        answer = last_line(out.stderr or out.stdout) or f"exit status {out.returncode}"
        raise SlurmError(f"{' '.join(args)} failed: {answer}")
    return out.stdout


def parse_record(line: str) -> dict[str, str]:
    """One record of ``scontrol -o show ...``: its Key=Value fields (a value runs to the next Key=, so it may hold
    spaces, as Reason= does)."""
    return {m.group(1): m.group(2).strip() for m in _FIELD.finditer(line.strip())}


# -- nodes ---------------------------------------------------------------------------------------------------------


def hostnames(nodelist: str) -> tuple[str, ...]:
    """A compressed node list (n[1-4]) expanded, in Slurm's order; () when there is none or scontrol fails."""
    if not nodelist:
        return ()
    out = _call(["scontrol", "show", "hostnames", nodelist])
    return tuple(out.stdout.split()) if out.returncode == 0 else ()


def node_states(nodes: list[str]) -> dict[str, tuple[set[str], str]]:
    """node -> (its state flags, Slurm's reason) from scontrol; nodes it does not answer for are left out."""
    if not nodes or shutil.which("scontrol") is None:
        return {}
    states = {}
    for line in _call(["scontrol", "-o", "show", "node", ",".join(nodes)]).stdout.splitlines():
        fields = parse_record(line)
        if "NodeName" in fields and "State" in fields:
            states[fields["NodeName"]] = (set(fields["State"].split("+")), fields.get("Reason", ""))
    return states


def describe(state: set[str], reason: str) -> str:
    return f"{'+'.join(sorted(state))} ({reason or 'no reason given'})"


def held_by_slurm(nodes: list[str]) -> dict[str, str]:
    """The nodes Slurm still holds down or drained, with its verdict (a bad node is not taken back while it
    stands). Without scontrol, or for nodes Slurm does not know (simulated ones), nothing."""
    return {
        node: describe(state, reason)
        for node, (state, reason) in node_states(nodes).items()
        if state & (FAILED_STATES | DRAINED_STATES)
    }


# -- jobs ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # RUNNING, PENDING, COMPLETED, ... or UNKNOWN when Slurm no longer knows the job
    reason: str = ""  # Slurm's Reason; for UNKNOWN, why neither the controller nor accounting knows the job
    restarts: int = 0
    source: str = "squeue"  # where the state comes from: squeue (the controller), sacct, or "" (UNKNOWN)

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


def job_states(job_ids: Iterable[str]) -> dict[str, JobState]:
    """Each job's state, in two calls at most whatever their number: squeue while the controller remembers the
    jobs (MinJobAge, default 300 s, after they end), then sacct for the rest if accounting (slurmdbd) has them;
    else UNKNOWN, with the reason. Array tasks are named ARRAY_TASK (``7_3``)."""
    ids = list(dict.fromkeys(str(j) for j in job_ids))
    if not ids:
        return {}
    found: dict[str, JobState] = {}
    # -r: one line per array task; -t all: finished jobs too, while the controller remembers them
    fmt = "JobArrayID:|,State:|,Reason:|,RestartCnt:|"
    out = _call(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(ids), "-O", fmt])
    for line in out.stdout.splitlines():
        cells = line.split("|")
        if len(cells) >= 4 and cells[0].strip() in ids:
            job, state, reason, restarts = (c.strip() for c in cells[:4])
            found[job] = JobState(job, state or "UNKNOWN", reason, int(restarts) if restarts.isdigit() else 0)
    missing = [j for j in ids if j not in found]
    if missing:
        error = last_line(out.stderr or out.stdout)
        # squeue lists the jobs it knows and leaves out the others; asked only for jobs it forgot, it fails so
        forgotten = out.returncode == 0 or "invalid job id" in error.lower()
        why = (
            "the controller no longer knows it (it forgets finished jobs MinJobAge after they end)"
            if forgotten
            else f"squeue: {error or 'no answer'}"
        )
        found.update(_accounted(missing, why))
    return {j: found[j] for j in ids}


def job_state(job_id: str) -> JobState:
    return job_states([job_id])[str(job_id)]


def _accounted(ids: list[str], why: str) -> dict[str, JobState]:
    """The jobs' last state in accounting (sacct: one line per run of a job, requeues included)."""
    if not shutil.which("sacct"):
        return {j: JobState(j, "UNKNOWN", f"{why}, and sacct (accounting) is not installed", source="") for j in ids}
    # -D: every run of the job (requeues included), the last is the current one. -X: the job, not its steps.
    acct = _call(["sacct", "-n", "-X", "-D", "-P", "-j", ",".join(ids), "-o", "JobID,State,Reason"])
    if acct.returncode != 0:
        answer = f"{why}, and sacct: {last_line(acct.stderr or acct.stdout)}"
        return {j: JobState(j, "UNKNOWN", answer, source="") for j in ids}
    runs: dict[str, list[tuple[str, str]]] = {}
    for line in acct.stdout.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if job in ids:
            runs.setdefault(job, []).append((state, reason))
    out = {}
    for j in ids:
        if j not in runs:
            out[j] = JobState(j, "UNKNOWN", f"{why}, and accounting (sacct) has no record of it", source="")
            continue
        state, reason = runs[j][-1]
        state, _, by = state.strip().partition(" ")  # "CANCELLED by 0" -> CANCELLED, the rest goes to the reason
        reason = " ".join(x for x in (by, "" if reason == "None" else reason) if x)
        out[j] = JobState(j, state or "UNKNOWN", reason, len(runs[j]) - 1, source="sacct")
    return out


@dataclass(frozen=True)
class Allocation:
    """One run of a job as accounting holds it (a requeued job has one per run): what the cluster charges for."""

    job_id: str
    state: str
    submit: float | None  # unix times; None where Slurm says Unknown/None (not started, not ended)
    eligible: float | None  # when it could start: its dependency met (a chain's link), its begin time reached
    start: float | None
    end: float | None
    elapsed_s: float  # so far, for a running job
    nodes: int
    gpus: int  # gres/gpu of AllocTRES, over all the job's nodes


_GPU_TRES = re.compile(r"(?:^|,)gres/gpu=(\d+)(?:,|$)")


def _epoch(cell: str) -> float | None:
    return float(cell) if cell.strip().isdigit() and int(cell) > 0 else None


def allocations(job_ids: Iterable[str]) -> tuple[dict[str, list[Allocation]], str]:
    """Every run of each job from accounting, in one sacct call: ({job: its runs, in sacct's order}, ""), or ({},
    why accounting could not answer). A job accounting has no record of is left out."""
    ids = list(dict.fromkeys(str(j) for j in job_ids))
    if not ids:
        return {}, ""
    if not shutil.which("sacct"):
        return {}, "sacct (accounting) is not installed"
    fields = "JobID,State,Submit,Eligible,Start,End,ElapsedRaw,AllocNodes,AllocTRES"
    env = {**os.environ, "SLURM_TIME_FORMAT": "%s"}  # unix times, not the login node's local time
    acct = _call(["sacct", "-n", "-X", "-D", "-P", "-j", ",".join(ids), "-o", fields], env=env)
    if acct.returncode != 0:
        return {}, f"sacct: {last_line(acct.stderr or acct.stdout) or f'exit status {acct.returncode}'}"
    out: dict[str, list[Allocation]] = {}
    for line in acct.stdout.splitlines():
        cells = line.strip().split("|")
        if len(cells) < 9 or cells[0] not in ids:
            continue
        job, state, submit, eligible, start, end, elapsed, nodes, tres = cells[:9]
        gpus = _GPU_TRES.search(tres)
        out.setdefault(job, []).append(
            Allocation(
                job_id=job,
                state=state.split(" ")[0] or "UNKNOWN",
                submit=_epoch(submit),
                eligible=_epoch(eligible),
                start=_epoch(start),
                end=_epoch(end),
                elapsed_s=float(elapsed) if elapsed.isdigit() else 0.0,
                nodes=int(nodes) if nodes.isdigit() else 0,
                gpus=int(gpus.group(1)) if gpus else 0,
            )
        )
    return out, ""


def update_job(job_id: str, **fields: str) -> None:
    """``scontrol update JobId=ID Key=Value...`` (e.g. ExcNodeList, Requeue)."""
    run(["scontrol", "update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items())])


def requeue(job_id: str, *, hold: bool = False) -> None:
    """Requeue a job (from inside it, this ends it at once), held with ``hold``."""
    run(["scontrol", "requeuehold" if hold else "requeue", job_id])


def hold(job_id: str) -> None:
    run(["scontrol", "hold", job_id])


def release(job_id: str) -> None:
    run(["scontrol", "release", job_id])


def cancel(job_ids: list[str], *, signal: str | None = None) -> None:
    """scancel the jobs, or send them ``signal`` (a name without SIG) and let them go on."""
    run(["scancel", *([f"--signal={signal}"] if signal else []), *job_ids])


def resubmit_self(job_id: str, exclude: str, environ: dict[str, str]) -> str:
    """From inside job ``job_id`` (a plain sbatch script's): the same batch script submitted again with this job's
    shape, limit and output, excluding ``exclude``; this job is made non-requeueable first (a node lost during it
    makes it a NODE_FAIL that Slurm requeues, and both jobs would train the run at once). The new job's id."""
    fields = parse_record(run(["scontrol", "-o", "show", "job", job_id]))
    script, out, limit = fields.get("Command", ""), fields.get("StdOut", ""), fields.get("TimeLimit", "")
    if not Path(script).is_file():
        raise SlurmError(f"the batch script {script or '(none)'} of job {job_id} is gone")
    try:
        update_job(job_id, Requeue="0")
    except SlurmError as exc:
        print(f"warning: job {job_id} could not be made non-requeueable: {exc}", file=sys.stderr)
    args = ["--parsable", f"--exclude={exclude}", f"--nodes={slurm_job_nodes(environ)[0] or ''}"]
    args += [f"--job-name={environ.get('SLURM_JOB_NAME', '')}", "--export=ALL", "--requeue", "--open-mode=append"]
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    args += [f"--ntasks-per-node={per_node}"] if per_node else []
    args += [f"--partition={environ['SLURM_JOB_PARTITION']}"] if environ.get("SLURM_JOB_PARTITION") else []
    args += [f"--account={environ['SLURM_JOB_ACCOUNT']}"] if environ.get("SLURM_JOB_ACCOUNT") else []
    args += [f"--time={limit}"] if limit and limit != "UNLIMITED" else []
    args += [f"--output={out}"] if out else []
    cwd = environ.get("SLURM_SUBMIT_DIR") or "."
    submitted = subprocess.run(["sbatch", *args, script], capture_output=True, text=True, cwd=cwd, check=False)
    if submitted.returncode != 0:
        raise SlurmError(f"sbatch failed: {last_line(submitted.stderr or submitted.stdout)}")
    return submitted.stdout.strip().split(";")[0]


def main(argv: list[str] | None = None) -> int:
    """``python -m hpc.slurmctl VERB JOB_ID [EXCLUDE]`` for sbatch/common.sh: ``requeue`` or ``requeuehold`` this
    job, or ``resubmit`` it excluding EXCLUDE (prints the new job's id)."""
    parser = argparse.ArgumentParser(prog="python -m hpc.slurmctl", description=main.__doc__.splitlines()[0])
    parser.add_argument("verb", choices=["requeue", "requeuehold", "resubmit"])
    parser.add_argument("job_id")
    parser.add_argument("exclude", nargs="?", default="")
    args = parser.parse_args(argv)
    try:
        if args.verb == "resubmit":
            print(resubmit_self(args.job_id, args.exclude, dict(os.environ)))
        else:
            requeue(args.job_id, hold=args.verb == "requeuehold")
    except SlurmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
