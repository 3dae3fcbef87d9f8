"""How a rank reports a failure and ends: failure.json before any output, the whole MPI job aborted where the
other ranks may be blocked in a collective, or a last meeting where every rank reached the same error."""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from pathlib import Path

from mpi4py import MPI

from rundir import RunDir
from trainer.env import patient_barrier


def report_failure(rundir: RunDir, rank: int, message: str, kind: str, suspects: list[dict] | None = None) -> None:
    """failure.json, then the message on stderr. In that order: once a rank of the MPI job has ended, MPICH's hydra
    ends every other rank the moment any of them writes to stdout or stderr, so a report printed first could be
    lost with the rank that was writing it (docs/measurements/notes-trainer.md)."""
    if rundir.root.is_dir():
        with contextlib.suppress(OSError):
            rundir.write_failure(rank, message, kind, suspects)
    print(f"error: {message}", file=sys.stderr, flush=True)


def abort_job(comm: MPI.Comm, status: int) -> None:
    """End every rank of the MPI job with ``status``, after flushing what this rank has written."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    comm.Abort(status)


def meet(comm: MPI.Comm, timeout_s: float = 30.0) -> None:
    """Wait, at most ``timeout_s``, until every rank has reached the same (collective) error. A rank that found it
    first (rank 0 checks a checkpoint's sizes alone) would otherwise leave while slower ranks are still building
    their process groups with it, and they would fail there ("Connection closed by peer") and end the job with a
    crash's status instead of the user error's."""
    if comm.Get_size() > 1:
        patient_barrier(comm, poll_s=0.005, timeout_s=timeout_s)


def describe(rank: int, exc: BaseException) -> str:
    """``rank R: Type: first line of the message (at file:line in function)``: the innermost frame, for a
    diagnosis that says where a bug was hit without the whole traceback."""
    text = str(exc).strip().splitlines()
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        f = frames[-1]
        try:
            name = str(Path(f.filename).resolve().relative_to(Path(__file__).resolve().parent.parent))
        except ValueError:
            name = f.filename
        where = f" (at {name}:{f.lineno} in {f.name})"
    return f"rank {rank}: {type(exc).__name__}: {text[0][:300] if text else ''}{where}"
