"""The tracker's sender, a process of its own beside rank 0 (``python -m trainer.observe.tracker_agent``): every
metrics.jsonl record, sent once.

Rank 0 (trainer/observe/tracker_sink.py) writes operations to this process's stdin as JSON lines: ``start`` (the
target, the run directory, the params, the log), ``begin`` (a launch's step, tags and files), ``record``,
``committed`` (a checkpoint's step), ``tags``, ``file`` and ``finish``; end of input is the end of the launch. A
process of its own, at the lowest CPU priority, so that the client's imports, its store and its sending neither
hold the trainer's GIL nor take a core the ranks need (bench/tracker_cost.py measures what is left).

A record waits until a committed checkpoint covers its step (``committed``), or the run is done: a launch that
fails recomputes the steps after its newest checkpoint, and those were never sent, so the tracker's history equals
metrics.jsonl (one value per step) across stops, restarts and requeues. The backlog a launch finds in metrics.jsonl
beyond ``sent_through`` (a tracker that was down, a launch killed before it sent) is sent first. A tracker that is
slow or down costs a warning and is retried with back-off.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from rundir.paths import RunDir, iter_jsonl, read_jsonl
from tracking import (
    Target,
    TrackingState,
    client_environment,
    hold_lock,
    open_backend,
    parent_of,
    pick,
    reconcile,
    send,
)

log = logging.getLogger("trainer.tracking")
BATCH_RECORDS = 500  # records per log_batch round (each ~25 metrics: MLflow's 1,000 per call, a few calls)
# Records ready to send kept in memory at most (~30 MB): beyond, a tracker that is down long drops them from memory
# and they are read back from metrics.jsonl (where every committed step's record is) once it is reachable again.
MAX_QUEUED = 10_000
MAX_BACKOFF_S = 30.0
CLOSING_BACKOFF_S = 2.0
PR_SET_PDEATHSIG = 1


class Sender:
    """The queue and the thread that sends it (this process's main thread reads rank 0's operations)."""

    def __init__(self, target: Target, rundir: RunDir, params: dict[str, str]) -> None:
        self.target, self.rundir, self.params = target, rundir, params
        self.state = TrackingState(target.backend, target.uri)  # read by the thread, under the tracking lock
        self._cond = threading.Condition()
        self._pending: list[dict] = []  # records no committed checkpoint covers yet
        self._ready: list[dict] = []  # records to send, in step order
        self._jobs: list[tuple] = []  # ("tags", dict) and ("file", path, folder), sent before the metrics
        self._end: str | None = None  # the run's status once the launch ends (FINISHED, KILLED, FAILED)
        self._covered = -1  # the newest committed checkpoint's step
        self._spilled_through = -1  # ready records through this step were dropped from memory: in metrics.jsonl
        self._closing = False
        self._backend = None
        self._down_since: float | None = None
        # this process's CPU seconds (opening: the client's import and the run; sending: the rest), and the records
        # it was given, in tracking.json's "cost" at the end
        self._written, self._open_cpu_s = 0, None
        client_environment(target)
        self._thread = threading.Thread(target=self._run, name="tracker", daemon=True)
        self._thread.start()  # imports the tracker's client and opens its run while the launch starts

    # -- rank 0's operations ---------------------------------------------------------------------------------
    def begin(self, step: int, tags: dict[str, str], files: list[tuple[Path, str | None]]) -> None:
        """After a resume moved recomputed records out of metrics.jsonl: its records (all at or before ``step``)
        that the tracker does not have yet are sent first; then this launch's tags and files."""
        backlog = [r for r in read_jsonl(self.rundir.metrics) if isinstance(r.get("step"), int) and r["step"] <= step]
        with self._cond:
            self._covered = max(self._covered, step)
            self._ready[:0] = backlog  # filtered against sent_through when sent
            self._bound()
            self._jobs.append(("tags", tags))
            self._jobs.extend(("file", path, folder) for path, folder in files)
            self._cond.notify()

    def write(self, record: dict) -> None:
        self._written += 1
        with self._cond:
            if record["step"] <= self._covered:  # its checkpoint committed before the record was complete
                self._ready.append(record)
                self._bound()
                self._cond.notify()
            else:
                self._pending.append(record)

    def committed(self, step: int) -> None:
        """A checkpoint of ``step`` is committed (called from the checkpoint's thread with async_save)."""
        with self._cond:
            self._covered = max(self._covered, step)
            ready = [r for r in self._pending if r["step"] <= step]
            if ready:
                self._pending = [r for r in self._pending if r["step"] > step]
                self._ready.extend(ready)
                self._bound()
                self._cond.notify()

    def _bound(self) -> None:
        """Under the lock: a queue grown past MAX_QUEUED (a tracker down for long) is dropped from memory; its
        records are read back from metrics.jsonl when they can be sent."""
        if len(self._ready) > MAX_QUEUED:
            self._spilled_through = max(self._spilled_through, *(r["step"] for r in self._ready))
            self._ready = []

    def tags(self, tags: dict[str, str]) -> None:
        with self._cond:
            self._jobs.append(("tags", tags))
            self._cond.notify()

    def file(self, path: Path, folder: str | None = None) -> None:
        with self._cond:
            self._jobs.append(("file", Path(path), folder))
            self._cond.notify()

    def finish(self, how: str) -> None:
        """The launch ends: "done" or "pruned" (every record goes: nothing will be recomputed), "stopped" or
        "failed"."""
        with self._cond:
            if how in ("done", "pruned"):
                self._ready.extend(self._pending)
                self._pending = []
            self._end = {"done": "FINISHED", "pruned": "KILLED", "stopped": "KILLED"}.get(how, "FAILED")
            self._jobs.append(("tags", {"hpc.state": how}))
            self._cond.notify()

    def close(self) -> None:
        """Send what is queued (rank 0 ends this process after tracking.flush_timeout_s), then the run's status."""
        with self._cond:
            if self._end is None:
                self._end = "FAILED"
            self._closing = True
            self._cond.notify()
        self._thread.join()
        with self._cond:
            self.state.cost = {
                "records": self._written,
                "open_cpu_s": self._open_cpu_s,
                "send_cpu_s": time.process_time() - (self._open_cpu_s or 0.0),
            }
            self._save()

    # -- the background thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        lock = hold_lock(self.rundir, wait=True)  # a report sending from the login node finishes first
        with self._cond:  # what that report sent, read under the lock
            self.state = TrackingState.load(self.rundir.tracking, self.target)
        try:
            self._loop()
        finally:
            if lock is not None:
                lock.close()

    def _loop(self) -> None:
        backoff, idle = 1.0, False
        while True:
            with self._cond:
                # at once (the client's import and the run's opening, while the launch starts), then on work
                while self._backend is not None and not (self._closing or self._jobs or self._ready_after()):
                    self._cond.wait()
                if self._closing and not self._jobs and not self._ready_after() and self._backend is not None:
                    break
            try:
                self._connect()
                self._send_jobs()
                self._send_metrics()
                if self._down_since is not None:
                    log.warning(
                        "tracking: %s reachable again after %.0f s; caught up to step %d",
                        self.target.shown,
                        time.monotonic() - self._down_since,
                        self.state.sent_through,
                    )
                    self._down_since = None
                backoff = 1.0
            except Exception as exc:  # a tracker that is down or refuses: warn, keep the queue, retry
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    log.warning(
                        "tracking: %s failed (%s); training goes on, metrics are kept and retried",
                        self.target.shown,
                        _one_line(exc),
                    )
                with self._cond:
                    self._cond.wait(backoff)
                # while the launch ends, only the flush is left to wait for: retried every few seconds
                backoff = min(CLOSING_BACKOFF_S if self._closing else MAX_BACKOFF_S, backoff * 2)
            if not idle:
                # The client's import and the run's opening (~2.8 CPU-s) ran at normal priority, inside the launch's
                # start-up; at SCHED_IDLE they were starved by the ranks' start-up and fell into the first steps.
                # Sending records (and this process's other threads) take only idle time from here on.
                idle = True
                _idle()
        try:
            if self.state.run_id is not None and self._end is not None:
                self._backend.end(self.state.run_id, self._end)
            if self.state.unsent:
                self.state.unsent = []
                self._save()
        except Exception as exc:
            log.warning("tracking: %s: ending the run failed: %s", self.target.shown, _one_line(exc))

    def _ready_after(self) -> bool:
        through = self.state.sent_through
        return self._spilled_through > through or any(r["step"] > through for r in self._ready)

    def _read_back(self, through: int) -> None:
        """Records dropped from memory (``_bound``), after step ``through``: the next MAX_QUEUED of them, from
        metrics.jsonl."""
        with self._cond:
            spilled = self._spilled_through
            if spilled <= through or any(through < r["step"] <= spilled for r in self._ready):
                return
        back = []
        for r in iter_jsonl(self.rundir.metrics):
            step = r.get("step")
            if isinstance(step, int) and through < step <= spilled:
                back.append(r)
                if len(back) >= MAX_QUEUED:
                    break
        with self._cond:
            self._ready[:0] = back
            if not back:  # nothing left to read (a file moved away): what is in memory goes on
                self._spilled_through = -1

    def _save(self) -> None:
        try:
            self.state.save(self.rundir.tracking)
        except OSError as exc:
            log.warning("tracking: cannot write %s: %s", self.rundir.tracking, exc)

    def _connect(self) -> None:
        if self._backend is not None:
            return
        backend = open_backend(self.target)
        created = self.state.run_id is None
        tags = {"hpc.run_dir": str(self.rundir.root)}
        parent = parent_of(self.rundir, self.target) if created else None
        if parent:  # a sweep element: a child of the sweep's run
            tags["mlflow.parentRunId"] = parent
        backend.open(self.state, tags)
        self._save()  # the run's id, before anything is sent to it
        if reconcile(backend, self.state):  # killed while a batch was being sent
            self._save()
        changed = backend.params(self.state.run_id, self.params)
        if changed:  # a resume with another config (MLflow's params are fixed once logged)
            stamp = int(time.time())
            backend.tags(self.state.run_id, {f"hpc.changed.{k}": f"{v} (at {stamp})" for k, v in changed.items()})
        self.state.params_logged = True
        self._save()
        self._open_cpu_s = time.process_time()
        if created:
            config = self.rundir.config
            if config.exists():
                backend.artifact(self.state.run_id, config)
        self._backend = backend

    def _send_jobs(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    return
                job = self._jobs[0]
            if job[0] == "tags":
                self._backend.tags(self.state.run_id, job[1])
            elif Path(job[1]).exists():
                self._backend.artifact(self.state.run_id, job[1], job[2])
            with self._cond:
                self._jobs.pop(0)

    def _send_metrics(self) -> None:
        while True:
            self._read_back(self.state.sent_through)
            with self._cond:  # a copy of the references; the sort runs outside the lock the loop's write() takes
                queued, through, spilled = list(self._ready), self.state.sent_through, self._spilled_through
            if spilled > through:  # the records read back come first: none after them until they are all sent
                queued = [r for r in queued if r["step"] <= spilled]
            batch = pick(queued, through, BATCH_RECORDS)
            if not batch:
                return
            send(self._backend, self.state, batch, self._save)
            with self._cond:
                self._ready = [r for r in self._ready if r["step"] > self.state.sent_through]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def _end_with_parent() -> None:
    """SIGTERM when rank 0 ends (Linux): a rank killed hard leaves no sender behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # it ended before prctl
        sys.exit(0)


def _idle() -> None:
    """Every thread of this process takes only CPU time the ranks leave idle: SCHED_IDLE (Linux) is below nice 19
    (weight 3 against 15 in the kernel's fair scheduler), so a sender that competes with busy ranks takes ~0.3% of a
    core, not ~1.5%. Linux sets both per thread: each thread there now (the client's own among them), by its id;
    threads started later inherit it."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def main() -> int:
    _end_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # tracking.json is written atomically: nothing torn
    start = json.loads(sys.stdin.readline())
    if start.get("log"):
        handler: logging.Handler = logging.FileHandler(start["log"])
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s rank 0 %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    sender = Sender(Target(**start["target"]), RunDir(Path(start["run_dir"])), start["params"])
    for line in sys.stdin:
        try:
            op = json.loads(line)
        except ValueError:
            continue  # a line cut short by a rank 0 that ended
        kind = op.get("op")
        if kind == "record":
            sender.write(op["record"])
        elif kind == "committed":
            sender.committed(op["step"])
        elif kind == "begin":
            sender.begin(op["step"], op["tags"], [(Path(p), f) for p, f in op["files"]])
        elif kind == "tags":
            sender.tags(op["tags"])
        elif kind == "file":
            sender.file(Path(op["path"]), op.get("folder"))
        elif kind == "finish":
            sender.finish(op["how"])
    sender.close()  # rank 0 waits tracking.flush_timeout_s for this process, then ends it
    return 0


if __name__ == "__main__":
    sys.exit(main())
