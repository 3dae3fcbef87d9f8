"""SIGTERM that the main thread cannot act on. The launcher ends a step with SIGTERM: srun's --kill-on-bad-exit after a
rank died, mpirun, a scancel. Python runs a signal's handler only when the main thread runs bytecode, and a stop acts
at the next step boundary. A rank whose main thread is blocked in one C++ call, most often a collective with a rank
that is gone, would wait for the scheduler's SIGKILL (Slurm's KillWait: 30 s by default).

``signal.set_wakeup_fd`` makes the C-level handler write the signal's number to a pipe, and a daemon thread reads it.
From SIGTERM on, the thread watches the main thread's phases (the hang watchdog's counter). Say the main thread
enters no phase for longer than the blocked limit (3 x the median recent step, at least BLOCKED_MIN_S), and that it
is in a phase whose one long call is a collective or a step's compute (BLOCKING_PHASES), not a checkpoint or an eval,
unless a rank of the launch has written its diagnosis (failure.json: then a checkpoint cannot complete). Then the
rank dumps its Python stacks into its log and exits 143, as an uncaught SIGTERM would end it. A rank that goes on
stops its usual way: a checkpoint at the next step boundary. Before the launch's first completed step there is no
step time to judge by, so nothing is done then."""

from __future__ import annotations

import logging
import os
import select
import signal
import statistics
import threading
import time
from collections import deque

from rundir import RunDir
from trainer.env import RuntimeEnv
from trainer.loop.stop import StopFlag
from trainer.observe.watchdog import Watchdog

log = logging.getLogger(__name__)
BLOCKED_MIN_S = 2.0  # the least a main thread must be blocked after SIGTERM before the rank ends itself
STEP_FACTOR = 3.0  # ... and this many times the median of the launch's recent step times (a step's longest call
# is shorter than the step; a checkpoint, which may take longer, is never cut)
SAMPLE_S = 0.5  # how often the thread samples the step counter (it wakes at once on a signal)
#: The step's phases whose one long call is a collective or a step's compute (trainer/loop/, the hooks): a rank is
#: ended only in these. A checkpoint, an eval or a rung may outlast a step and must finish; a data wait is no
#: collective.
BLOCKING_PHASES = frozenset({
    "forward/backward", "waiting for the gradient all-reduce", "gradient all-reduce (hierarchical hook)",
    "optimizer", "metric all-reduce", "straggler all-gather", "replica check",
})  # fmt: skip
TERM_EXIT = 128 + signal.SIGTERM  # the shell's status of a process SIGTERM ended


class TermWatch:
    def __init__(self, stop: StopFlag, watchdog: Watchdog, env: RuntimeEnv, rundir: RunDir) -> None:
        self.stop, self.watchdog, self.env, self.rundir = stop, watchdog, env, rundir
        self.step_times: deque[float] = deque(maxlen=8)  # seconds per step, one figure per sample with progress
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self.earlier = self._failure_id()  # an earlier launch's failure.json, if one was left (not this launch's)

    def start(self) -> None:
        """Main thread only (``set_wakeup_fd``); nothing when SIGTERM is not one of the run's stop signals (its
        default action ends the rank at once) or another wakeup fd is set (that owner's, left alone)."""
        if threading.current_thread() is not threading.main_thread() or not self.stop.catches(signal.SIGTERM):
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._pipe = (read_fd, write_fd)
        self._thread = threading.Thread(target=self._run, args=(read_fd,), name="hpc-term-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._pipe is None:
            return
        read_fd, write_fd = self._pipe
        self._pipe = None
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
        os.close(write_fd)
        if self._thread is not None:
            self._thread.join(timeout=2 * SAMPLE_S + 1)
        os.close(read_fd)

    def limit(self) -> float | None:
        """Seconds the main thread may stay blocked after SIGTERM; None before a step time is known."""
        if not self.step_times:
            return None
        return max(BLOCKED_MIN_S, STEP_FACTOR * statistics.median(self.step_times))

    # -- its thread ---------------------------------------------------------------------------------------------
    def _run(self, read_fd: int) -> None:
        seen_step, seen_at, counted = self.watchdog.step, time.monotonic(), False
        while self._pipe is not None:
            ready, _, _ = select.select([read_fd], [], [], SAMPLE_S)
            step, now = self.watchdog.step, time.monotonic()
            if step > seen_step:
                if counted:  # the first progress of a launch holds its start-up (compilation, the first batch)
                    self.step_times.append((now - seen_at) / (step - seen_step))
                seen_step, seen_at, counted = step, now, True
            if not ready:
                continue
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self.watchdog.sigterm_at = now  # a collective failing from now on names nobody (watchdog.diagnose)
                self._judge(now)

    def _judge(self, arrived: float) -> None:
        """SIGTERM's byte was read at ``arrived``: from then on, end the rank once its main thread has entered no
        phase for longer than the limit (in one of BLOCKING_PHASES). Its handler may have run just before a collective
        that never completes, so the watch goes on until the process ends."""
        seq, since = self.watchdog.seq, arrived
        while self._pipe is not None:
            now = time.monotonic()
            if self.watchdog.seq != seq:  # the main thread goes on: a stop on its way, or work
                seq, since = self.watchdog.seq, now
            limit = self.limit()
            late = limit is not None and now - since > limit
            if late and (self.watchdog.phase in BLOCKING_PHASES or self._diagnosed()):
                self._end(now - arrived)
            time.sleep(0.05)

    def _diagnosed(self) -> bool:
        """Whether a rank of this launch has written its diagnosis (failure.json): the launch is over, and a
        checkpoint's collectives, which wait on every rank, cannot complete. (Without one, a checkpoint blocked
        after SIGTERM may be waiting on a slow writer, and is left to finish.)"""
        now = self._failure_id()
        return now is not None and now != self.earlier

    def _failure_id(self) -> tuple[int, int] | None:
        try:
            st = self.rundir.failure.stat()  # written atomically (a rename): a new one is a new inode
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _end(self, waited: float) -> None:
        w, env = self.watchdog, self.env
        log.error(
            "rank %d (%s): SIGTERM arrived %.1f s ago and the main thread has been in '%s' of step %d for %.1f s "
            "(one call that does not return, most often a collective with a rank that is gone): the rank ends now, "
            "as SIGTERM's default action would, rather than at the scheduler's SIGKILL. Its Python stacks are in "
            "its log.",
            env.rank, env.node_names[env.rank], waited, w.phase, w.step, time.time() - w.since,
        )  # fmt: skip
        w.dump_stacks("SIGTERM while blocked")
        os._exit(TERM_EXIT)
