"""Retrying file I/O that failed with a transient error of a network or parallel file system (torch-free).

Lustre, GPFS and NFS report a server fail-over, a lost lock or a congested link as EIO, ESTALE, ETIMEDOUT and the
like on one client, for a few seconds; the same call then succeeds. A checkpoint write or a data read that fails
so is tried again after a back-off that doubles (with jitter, so that ranks that failed together do not retry
together), up to a number of attempts and a total time. Errors that repeating cannot fix (a full disk, a missing
or read-only file, no permission) fail at once. When the retries are exhausted the original error propagates, with
a note of the attempts: the launch fails as a crash, which the launcher restarts in the job (hpc/policy/decide.py),
not as bad input.

The checkpointer's collective saves and loads use ``RetryPolicy.allows`` and ``RetryPolicy.jittered`` to let every
rank take the same decision; single-process operations (a data window, rank 0's scan of the generations) use
``retry``.
"""

from __future__ import annotations

import errno
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

#: errno values a network or parallel file system returns for a fault that passes: retried.
TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("EIO", "ESTALE", "ETIMEDOUT", "EAGAIN", "EWOULDBLOCK", "ECONNRESET", "ENOLCK", "EREMOTEIO", "EBUSY")
    if hasattr(errno, name)
)
MAX_DELAY_S = 30.0  # one back-off never waits longer
BUDGET_S = 120.0  # no retry starts after this long: below the defaults of comm.timeout_s and monitor.hang_timeout_s
# HDF5's POSIX driver reports the system error in its message: "... (file read failed: time = ..., filename = '...',
# file descriptor = 3, errno = 5, error message = 'Input/output error', ...)". Where h5py leaves OSError.errno None
# (some versions), the errno is read from that message.
_HDF5_ERRNO = re.compile(r"file (?:read|write) failed:.*?\berrno = (\d+)", re.DOTALL)
_jitter = random.Random()  # its own generator: retries must not draw from the training's `random` stream


class GaveUp(OSError):
    """Transient storage errors outlived the retries of a collective operation (a checkpoint save or load): raised
    on every rank with the same message, so that rank 0 can report it and every rank end with the crash status
    (restarted in the job) without aborting the others. ``str()`` is the message alone."""

    collective = True

    def __str__(self) -> str:
        return str(self.strerror)


def io_errno(exc: BaseException) -> int | None:
    """The system errno behind an OSError (h5py's included), else None."""
    if not isinstance(exc, OSError):
        return None
    if exc.errno is not None:
        return exc.errno
    m = _HDF5_ERRNO.search(str(exc))
    return int(m.group(1)) if m else None


def is_transient(exc: BaseException) -> bool:
    """True for an OSError whose errno is one a storage fault that passes gives (EIO, ESTALE, ETIMEDOUT, ...)."""
    return io_errno(exc) in TRANSIENT_ERRNOS


def errno_name(exc: BaseException) -> str:
    code = io_errno(exc)
    return errno.errorcode.get(code, str(code)) if code is not None else type(exc).__name__


def describe(exc: BaseException) -> str:
    """``EIO (Input/output error)``: the errno's name and text, for a log line."""
    strerror = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:200]
    return f"{errno_name(exc)} ({strerror})"


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` further attempts after the first (0: none), the first after ``backoff_s``, each next one twice as
    late (at most ``max_delay_s``), and none that would start later than ``budget_s`` after the first attempt.
    ``setting`` names the config key, for messages."""

    retries: int
    backoff_s: float
    setting: str
    max_delay_s: float = MAX_DELAY_S
    budget_s: float = BUDGET_S

    @property
    def attempts(self) -> int:
        return self.retries + 1

    def delay(self, attempt: int) -> float:
        """The back-off after failed attempt ``attempt`` (1-based), before jitter."""
        return min(self.max_delay_s, self.backoff_s * 2 ** (attempt - 1))

    def allows(self, attempt: int, elapsed_s: float) -> bool:
        """Whether another attempt follows failed attempt ``attempt``, ``elapsed_s`` after the first began.
        A pure function of its arguments: ranks that share them take the same decision."""
        return attempt < self.attempts and elapsed_s + self.delay(attempt) <= self.budget_s

    def jittered(self, attempt: int) -> float:
        """The back-off to sleep: between half and all of ``delay`` (ranks that failed together spread out)."""
        return self.delay(attempt) * _jitter.uniform(0.5, 1.0)

    def gave_up(self, exc: BaseException, attempts: int, elapsed_s: float) -> None:
        """Add a note of the attempts made to ``exc`` (for the traceback and failure.json)."""
        exc.add_note(
            f"gave up after {attempts} attempt(s) over {elapsed_s:.1f} s ({self.setting}={self.retries}, "
            f"at most {self.budget_s:g} s of retries)"
        )


def retry(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    what: str,
    path: object = None,
    log: logging.Logger,
    on_failure: Callable[[OSError], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``fn()``, tried again while it fails with a transient error and ``policy`` allows. Each retry is a WARNING
    on ``log`` naming ``what`` (e.g. "data read of"), the file (the error's, else ``path``), the errno, the attempt
    and the delay. ``on_failure`` runs after each transient failure (say, to drop a stale file handle). Any other
    error propagates at once; the last transient one propagates with a note of the attempts."""
    start = time.monotonic()
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except OSError as exc:
            if not is_transient(exc):
                raise
            if on_failure is not None:
                on_failure(exc)
            elapsed = time.monotonic() - start
            if not policy.allows(attempt, elapsed):
                log.error(
                    "%s %s failed with %s, attempt %d/%d; giving up",
                    what,
                    exc.filename or path or "",
                    describe(exc),
                    attempt,
                    policy.attempts,
                )
                policy.gave_up(exc, attempt, elapsed)
                raise
            delay = policy.jittered(attempt)
            log.warning(
                "%s %s failed with %s, attempt %d/%d; retrying in %.2f s",
                what,
                exc.filename or path or "",
                describe(exc),
                attempt,
                policy.attempts,
                delay,
            )
            sleep(delay)
    raise AssertionError("not reached")
