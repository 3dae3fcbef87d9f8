"""One run, one trainer at a time: ``RUN_DIR/lock.json`` names who trains the run now, a process of this host (a
local launch, or a submission in progress) or the run's Slurm jobs, and a second launch is refused while that
holder lives. Liveness is checked, not assumed: a process by its PID and start time (a reused PID is another
process), jobs by Slurm's state; a holder that is gone is replaced. ``lock.json`` is read and written under an
flock of ``RUN_DIR/.lock``, so two launches cannot both take it (torch-free).

``python -m hpc.runlock hand-over RUN_DIR JOB_ID``: a job that ends for a continuation job names it first."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from hpc import slurmctl
from rundir import RunDir
from storage.files import write_json_atomic


class RunLocked(RuntimeError):
    """The run is being trained by someone else now; the message names the holder."""


@dataclass(frozen=True)
class Holder:
    host: str = ""
    pid: int = 0
    pid_start: str = ""  # /proc/PID/stat's start time: the same PID later is another process
    jobs: tuple[str, ...] = ()
    token: str = ""  # handed to the jobs a submission makes, so that they know the lock as theirs
    what: str = ""  # what the process is doing ("a local launch", "a submission to Slurm")
    time: float = field(default_factory=time.time)


def _start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]  # field 22, counted after the command name


def this_process(what: str) -> Holder:
    pid = os.getpid()
    return Holder(host=socket.gethostname(), pid=pid, pid_start=_start_time(pid), token=secrets.token_hex(8), what=what)


def _read(rundir: RunDir) -> Holder | None:
    try:
        fd = os.open(rundir.lock, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RunLocked(f"run {rundir.root}: {rundir.lock} cannot be read ({exc.strerror}); refused") from None
    with os.fdopen(fd) as f:
        try:
            data = json.load(f)
            return Holder(**{**data, "jobs": tuple(str(j) for j in data.get("jobs", ()))})
        except (ValueError, TypeError):
            return None  # a torn or foreign file names no one: replaced


def _write(rundir: RunDir, holder: Holder | None) -> None:
    if holder is None or not (holder.pid or holder.jobs):
        rundir.lock.unlink(missing_ok=True)
    else:
        write_json_atomic(rundir.lock, {**asdict(holder), "jobs": list(holder.jobs)})


@contextlib.contextmanager
def _guarded(rundir: RunDir) -> Iterator[None]:
    fd = os.open(rundir.lock_guard, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def holding(rundir: RunDir, holder: Holder) -> str | None:
    """Why ``holder`` still trains the run (one phrase naming it), or None when it is gone."""
    if holder.pid:
        if holder.host != socket.gethostname():
            return (
                f"{holder.what or 'process'} {holder.pid} on host {holder.host} (not this host: its end cannot be seen)"
            )
        if holder.pid_start and _start_time(holder.pid) == holder.pid_start:
            return f"{holder.what or 'process'} {holder.pid} on this host"
    if holder.jobs:
        states = slurmctl.job_states(holder.jobs)
        for job, state in states.items():
            if state.state == "UNKNOWN" and state.reason.startswith("squeue:"):
                return f"Slurm job {job} (its state cannot be read: {state.reason})"
            if not state.finished:
                return f"Slurm job {job} ({state.state})"
    return None


def _refusal(rundir: RunDir, who: str) -> RunLocked:
    return RunLocked(
        f"run {rundir.root} is being trained by {who}: a second launch would train it at the same time. Wait for it "
        f"to end, or stop it first; if it is gone and this is wrong, remove {rundir.lock}."
    )


def take(rundir: RunDir, holder: Holder) -> Holder:
    """Make ``holder`` the run's holder, or raise ``RunLocked`` naming the live one."""
    with _guarded(rundir):
        old = _read(rundir)
        if old is not None:
            who = holding(rundir, old)
            if who:
                raise _refusal(rundir, who)
        _write(rundir, holder)
    return holder


def join(rundir: RunDir, job_id: str, token: str = "") -> None:
    """A Slurm job starting to train the run: refused while another holder lives, unless the lock is this job's
    (a requeue, a chain's link, a continuation handed over) or its submission's (``token``)."""
    with _guarded(rundir):
        old = _read(rundir)
        if old is not None and (job_id in old.jobs or (token and old.token == token)):
            _write(rundir, replace(old, jobs=tuple(dict.fromkeys((*old.jobs, job_id)))))
            return
        who = holding(rundir, old) if old is not None else None
        if who:
            raise _refusal(rundir, who)
        _write(rundir, Holder(jobs=(job_id,), token=token, what="Slurm"))


def hand_over(rundir: RunDir, holder: Holder | None, job_ids: list[str]) -> None:
    """The run's jobs take over from ``holder`` (a submission ending) or join the jobs holding it (a job ending for
    its continuation)."""
    with _guarded(rundir):
        old = _read(rundir)
        if old is not None and holder is not None and old.token != holder.token and holding(rundir, old):
            return  # someone else holds it now: theirs
        kept = old is not None and (holder is None or old.token == holder.token)
        jobs = (*(old.jobs if kept else ()), *job_ids)
        token = old.token if kept else ""
        _write(rundir, Holder(jobs=tuple(dict.fromkeys(jobs)), token=token, what="Slurm"))


def release(rundir: RunDir, holder: Holder) -> None:
    """``holder`` (a local launch) is done: the lock goes, if it is still ``holder``'s."""
    with contextlib.suppress(OSError), _guarded(rundir):
        old = _read(rundir)
        if old is not None and old.token == holder.token:
            _write(rundir, None)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "hand-over":
        print("usage: python -m hpc.runlock hand-over RUN_DIR JOB_ID", file=sys.stderr)
        return 2
    hand_over(RunDir(Path(args[1])), None, [args[2]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
