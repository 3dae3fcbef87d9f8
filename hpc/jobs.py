"""A run's Slurm jobs (torch-free): their ids from RUN_DIR/jobs.jsonl, their states in one batched query, and what
the launchers do to them (keep pending links off bad nodes, make a running job non-requeueable), all through
hpc/slurmctl.py."""

from __future__ import annotations

import time

from hpc import slurmctl
from hpc.slurmctl import JobState
from rundir import RunDir
from rundir.paths import read_jsonl
from storage.files import append_jsonl


def job_ids(rundir: RunDir) -> list[str]:
    return [str(j["job_id"]) for j in read_jsonl(rundir.jobs) if "job_id" in j]


def record_job(rundir: RunDir, job_id: str, *, chain: tuple[int, int], exclude: tuple[str, ...], reason: str) -> None:
    """A submitted job of the run, in jobs.jsonl (which the verbs and the next links read)."""
    record: dict = {"job_id": job_id, "chain": list(chain), "time": time.time()}
    if exclude:
        record["exclude"] = list(exclude)
    if reason:
        record["reason"] = reason
    append_jsonl(rundir.jobs, record)


def states(rundir: RunDir) -> list[JobState]:
    """The state of each of the run's jobs, in submission order (one squeue call, one sacct call at most)."""
    ids = job_ids(rundir)
    return list(slurmctl.job_states(ids).values())


def states_of(rundirs: list[RunDir]) -> list[list[JobState]]:
    """``states`` for several runs (a sweep's elements, `hpc runs`' folders) in one batched query."""
    ids = [job_ids(rundir) for rundir in rundirs]
    known = slurmctl.job_states(j for run in ids for j in run)
    return [[known[j] for j in run] for run in ids]


def unfinished(rundir: RunDir) -> list[str]:
    return [j.job_id for j in states(rundir) if not j.finished]


def pending_jobs(rundir: RunDir, skip: set[str]) -> list[str]:
    """The run's jobs that are still pending (later links of a chain)."""
    return [j.job_id for j in states(rundir) if j.job_id not in skip and j.state == "PENDING"]


def exclude_pending(rundir: RunDir, nodes: tuple[str, ...], skip: set[str]) -> tuple[list[str], list[str]]:
    """Set ``nodes`` as the exclusions of the run's pending jobs (not ``skip``); (the pending jobs, those scontrol
    refused, each warned of)."""
    pending, refused = pending_jobs(rundir, skip=skip), []
    for job in pending:
        try:
            slurmctl.update_job(job, ExcNodeList=",".join(nodes))
        except slurmctl.SlurmError as exc:
            print(f"warning: the exclusions of pending job {job} were not set to {','.join(nodes) or 'none'}: {exc}",
                  flush=True)  # fmt: skip
            refused.append(job)
    return pending, refused


def never_requeue(job_id: str) -> None:
    """Make a running job non-requeueable (Requeue=0), so that Slurm ends it for good whatever it ends with."""
    if not job_id:
        return
    try:
        slurmctl.update_job(job_id, Requeue="0")
    except slurmctl.SlurmError as exc:
        print(f"warning: job {job_id} could not be made non-requeueable: {exc}", flush=True)
