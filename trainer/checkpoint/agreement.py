"""How the ranks agree on a checkpoint: one way for every phase of a save and of a restore.

Every rank learns every rank's outcome of a phase (a failure with its cause, or a payload such as the digests of the
files it wrote) through ``torch.distributed``'s object collectives on the checkpoint's process group: its own gloo
group where saves run in the background or the training collectives run on NCCL, else the default gloo group. One
group, usable from the background thread of an async save, and a wait that blocks in a socket rather than spinning
on a core. Each phase must end within the group's timeout on every rank (``comm.timeout_s`` on the default group;
torch's default for a group of its own).

A phase whose failures are all transient storage errors (storage/ioretry.py) is retried as a unit, on every rank,
while ``checkpoint.io_retries`` allows: the decision depends only on what every rank gathered, so every rank takes
the same one.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from storage.ioretry import GaveUp, RetryPolicy, describe, io_errno, is_transient, retry
from trainer.errors import UserError

log = logging.getLogger(__name__)
T = TypeVar("T")


class Failed(Exception):
    """A phase of a collective save or load failed on some rank: raised on every rank with every rank's report, so
    that every rank takes the same decision. ``cause``: this rank's own exception."""

    def __init__(self, reports: list[dict], elapsed_s: float, cause: BaseException | None) -> None:
        super().__init__(reports[0]["message"])
        self.reports, self.elapsed_s, self.cause = reports, elapsed_s, cause
        self.attempts = 1

    @property
    def transient(self) -> bool:
        return all(r["transient"] for r in self.reports)

    @property
    def retryable(self) -> bool:
        return self.transient and not any(r["final"] for r in self.reports)


class Agreement:
    """The ranks of one checkpointer, agreeing on the checkpoint's process group (None: the default group)."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None, policy: RetryPolicy) -> None:
        self.rank, self.world_size, self.group, self.policy = rank, world_size, group, policy

    def gather(self, value: Any) -> list:
        """Every rank's ``value``, in rank order, on every rank."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def from_rank0(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (what rank 0 read alone)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)  # every group here holds every rank, in order
        return box[0]

    def agree(
        self, error: tuple[BaseException, str] | None, began: float, *, final: bool = False, payload: Any = None
    ) -> list:
        """Every rank learns every rank's failure of this phase: if any rank failed, every rank raises ``Failed``
        with the same reports; else the payloads, in rank order. ``error`` is this rank's (exception, one-line
        message); ``final``: not to be retried as a unit."""
        report = None
        if error is not None:
            origin, cause = exception_origin(error[0], self.rank)
            report = {
                "rank": origin,
                "message": error[1],
                "file": str(getattr(cause, "filename", None) or "a file"),
                "error": describe(cause),
                "errno": io_errno(cause),
                "transient": is_transient(cause),
                "final": final,
            }
        gathered = self.gather((report, time.monotonic() - began, payload))
        reports = list({(r["rank"], r["message"]): r for r, _, _ in gathered if r}.values())
        if reports:
            raise Failed(reports, max(e for _, e, _ in gathered), error[0] if error else None)
        return [p for _, _, p in gathered]

    def retrying(self, what: str, attempt: Callable[[float], None]) -> None:
        """``attempt(began)`` on every rank, again on every rank while its failures are all transient and
        checkpoint.io_retries allows. Raises the last ``Failed``."""
        began = time.monotonic()
        for n in itertools.count(1):
            try:
                return attempt(began)
            except Failed as failed:
                failed.attempts = n
                if not (failed.retryable and self.policy.allows(n, failed.elapsed_s)):
                    raise
                delay = self.policy.jittered(n)
                for r in failed.reports:
                    log.warning(
                        "%s: rank %d: %s failed with %s, attempt %d/%d; every rank retries in %.2f s",
                        what,
                        r["rank"],
                        r["file"],
                        r["error"],
                        n,
                        self.policy.attempts,
                        delay,
                    )
                time.sleep(delay)

    def alone(self, fn: Callable[[], T], path: Path) -> T:
        """``fn()`` on this rank alone, retried after transient storage errors (checkpoint.io_retries)."""
        return retry(fn, self.policy, what="checkpoint I/O on", path=path, log=log)

    def gave_up_after(self, failed: Failed) -> str:
        """How a unit of every rank ended after its retries (a commit's message says so itself)."""
        if failed.reports[0]["final"]:
            return ""
        return (
            f" (a transient error on {failed.attempts} attempt(s) over {failed.elapsed_s:.1f} s, "
            f"checkpoint.io_retries={self.policy.retries})"
        )


def notes(exc: BaseException) -> str:
    """The notes on ``exc`` (storage/ioretry.py's "gave up after N attempt(s) ..."), each in parentheses."""
    return "".join(f" ({note})" for note in getattr(exc, "__notes__", []))


def read_failed(exc: OSError, what: str) -> tuple[int | None, str]:
    """(errno, message) of a restore read that failed for good: the errno of a transient error (a crash,
    restarted), None for any other (bad input); the message names ``what`` and keeps the retries' notes."""
    return io_errno(exc) if is_transient(exc) else None, f"reading {what} failed: {exc}{notes(exc)}"


def raise_crash(crash: tuple[int | None, str] | None) -> None:
    """Raise, on every rank, a restore read that failed for good (``read_failed``): GaveUp or UserError."""
    if crash:
        raise GaveUp(*crash) if crash[0] is not None else UserError(crash[1], collective=True)


def exception_origin(exc: BaseException, rank: int) -> tuple[int, BaseException]:
    """(the rank it happened on, the error behind it): DCP wraps each rank's exception in CheckpointException,
    which every rank raises; the OSError behind a wrapper where there is one."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (exc, _) = min(exc.failures.items(), key=lambda kv: kv[0])
    while not isinstance(exc, OSError) and (exc.__cause__ or exc.__context__):
        exc = exc.__cause__ or exc.__context__
    return rank, exc


def root_cause(exc: BaseException) -> str:
    """One line for the error behind a failed save or load."""
    _, exc = exception_origin(exc, 0)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f" ({exc.filename})" if exc.filename else "")
    return (f"{type(exc).__name__}: {exc}").splitlines()[0][:300]
