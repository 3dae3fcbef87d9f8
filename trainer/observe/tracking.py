"""Rank 0's experiment tracker: every metrics.jsonl record, sent from a background thread, once.

A record waits until a committed checkpoint covers its step (``committed``), or the run is done: a launch that
fails recomputes the steps after its newest checkpoint, and those were never sent, so the tracker's history equals
metrics.jsonl (one value per step) across stops, restarts and requeues. The backlog a launch finds in metrics.jsonl
beyond ``sent_through`` (a tracker that was down, a launch killed before it sent) is sent first. The training loop
only appends to a list under a lock; a tracker that is slow or down costs a warning and is retried with back-off.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from runconfig.rundir import RunDir, read_jsonl
from runconfig.tracking import (
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
MAX_BACKOFF_S = 30.0
CLOSING_BACKOFF_S = 2.0


class Tracker:
    def __init__(self, target: Target, rundir: RunDir, params: dict[str, str], flush_timeout_s: float) -> None:
        self.target, self.rundir, self.params, self.flush_timeout_s = target, rundir, params, flush_timeout_s
        self.state = TrackingState.load(rundir.tracking, target)
        self._cond = threading.Condition()
        self._pending: list[dict] = []  # records no committed checkpoint covers yet
        self._ready: list[dict] = []  # records to send, in step order
        self._jobs: list[tuple] = []  # ("tags", dict) and ("file", path, folder), sent before the metrics
        self._end: str | None = None  # the run's status once the launch ends (FINISHED, KILLED, FAILED)
        self._covered = -1  # the newest committed checkpoint's step
        self._closing = False
        self._backend = None
        self._down_since: float | None = None
        self._failures = 0
        # what tracking costs this process: the loop's time in write() and the background thread's CPU seconds
        # (opening: the client's import and the run; sending: the rest), in tracking.json's "cost" at the end
        self._write_s, self._written, self._open_cpu_s, self._cpu_s = 0.0, 0, None, None
        client_environment(target)
        self._thread = threading.Thread(target=self._run, name="tracker", daemon=True)
        self._thread.start()  # imports the tracker's client and opens its run while the launch starts

    # -- the training loop's side: appends under a lock, never waits for the tracker --------------------------
    def begin(self, step: int, tags: dict[str, str], files: list[tuple[Path, str | None]]) -> None:
        """After a resume moved recomputed records out of metrics.jsonl: its records (all at or before ``step``)
        that the tracker does not have yet are sent first; then this launch's tags and files."""
        backlog = [r for r in read_jsonl(self.rundir.metrics) if isinstance(r.get("step"), int) and r["step"] <= step]
        with self._cond:
            self._covered = max(self._covered, step)
            self._ready[:0] = backlog  # filtered against sent_through when sent
            self._jobs.append(("tags", tags))
            self._jobs.extend(("file", path, folder) for path, folder in files)
            self._cond.notify()

    def write(self, record: dict) -> None:
        began = time.perf_counter()
        with self._cond:
            if record["step"] <= self._covered:  # its checkpoint committed before the record was complete
                self._ready.append(record)
                self._cond.notify()
            else:
                self._pending.append(record)
        self._write_s += time.perf_counter() - began
        self._written += 1

    def committed(self, step: int) -> None:
        """A checkpoint of ``step`` is committed (called from the checkpoint's thread with async_save)."""
        with self._cond:
            self._covered = max(self._covered, step)
            ready = [r for r in self._pending if r["step"] <= step]
            if ready:
                self._pending = [r for r in self._pending if r["step"] > step]
                self._ready.extend(ready)
                self._cond.notify()

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
        """Wait up to tracking.flush_timeout_s for the queue to be sent; what is left is named (sent later)."""
        with self._cond:
            if self._end is None:
                self._end = "FAILED"
            self._closing = True
            self._cond.notify()
        self._thread.join(self.flush_timeout_s)
        if self._cpu_s is not None:
            self.state.cost = {
                "records": self._written,
                "write_us_per_record": 1e6 * self._write_s / max(1, self._written),
                "open_cpu_s": self._open_cpu_s,
                "send_cpu_s": self._cpu_s - (self._open_cpu_s or 0.0),
            }
            self._save()
        if self._thread.is_alive():
            with self._cond:
                steps = sorted(r["step"] for r in self._ready if r["step"] > self.state.sent_through)
                if steps:
                    self.state.unsent = [steps[0], steps[-1]]
                    self._save()
            gap = f"steps {steps[0]}..{steps[-1]} not sent; " if steps else ""
            log.warning(
                "tracking: %s did not take the queue within tracking.flush_timeout_s=%g s: %sthe next launch or "
                "`python -m hpc report %s` sends them",
                self.target.shown,
                self.flush_timeout_s,
                gap,
                self.rundir.root,
            )

    # -- the background thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        # The lowest CPU priority for this thread alone (Linux: a thread is a task of its own): where the ranks use
        # every core, the tracker's work waits for idle moments instead of slowing the steps after a commit.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        lock = hold_lock(self.rundir, wait=True)  # a report sending from the login node finishes first
        with self._cond:  # what that report sent, read under the lock
            self.state = TrackingState.load(self.rundir.tracking, self.target)
        try:
            self._loop()
        finally:
            self._cpu_s = time.thread_time()
            if lock is not None:
                lock.close()

    def _loop(self) -> None:
        backoff = 1.0
        while True:
            with self._cond:
                while not (self._closing or self._jobs or self._ready_after()):
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
                self._failures += 1
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
        try:
            if self.state.run_id is not None and self._end is not None:
                self._backend.end(self.state.run_id, self._end)
            if self.state.unsent:
                self.state.unsent = []
                self._save()
        except Exception as exc:
            log.warning("tracking: %s: ending the run failed: %s", self.target.shown, _one_line(exc))

    def _ready_after(self) -> bool:
        return any(r["step"] > self.state.sent_through for r in self._ready)

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
        self._open_cpu_s = time.thread_time()
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
            with self._cond:  # a copy of the references; the sort runs outside the lock the loop's write() takes
                queued, through = list(self._ready), self.state.sent_through
            batch = pick(queued, through, BATCH_RECORDS)
            if not batch:
                return
            send(self._backend, self.state, batch, self._save)
            with self._cond:
                self._ready = [r for r in self._ready if r["step"] > self.state.sent_through]


def launch_tags(cfg, env, layout: dict, launch_record: dict | None, rundir: RunDir, code_sha256: str | None) -> dict:
    """What identifies this launch in the tracker: Slurm ids, restarts, world and layout, hosts, code, versions."""
    from trainer.checkpoint.provenance import git_commit

    events = read_jsonl(rundir.history)
    tags = {
        "hpc.state": "running",
        "hpc.launch": env.launch_id,
        "hpc.launches": str(sum(1 for e in events if e.get("event") in ("start", "resume"))),
        "hpc.restarts": str(sum(1 for e in events if e.get("event") == "restart")),
        "hpc.slurm_job_id": env.slurm_job_id or "",
        "hpc.slurm_restart_count": str(env.slurm_restart_count or 0),
        "hpc.world_size": str(env.world_size),
        "hpc.layout": json.dumps(layout, sort_keys=True),
        "hpc.hosts": ",".join(dict.fromkeys(env.node_names)),
        "hpc.recipe": cfg.recipe,
        "hpc.code_sha256": code_sha256 or "",
        "hpc.package_commit": git_commit() or "",
    }
    if launch_record:
        for key, value in (launch_record.get("software") or {}).items():
            tags[f"hpc.{key}"] = "" if value is None else str(value)
        nodes = launch_record.get("nodes") or {}
        cpus = sorted({str(n.get("cpu")) for n in nodes.values() if n.get("cpu")})
        gpus = sorted({g.get("name", "") for n in nodes.values() for g in n.get("gpus", [])} - {""})
        tags["hpc.cpu"] = "; ".join(cpus)
        tags["hpc.gpu"] = "; ".join(gpus)
    project = _newest_submission(rundir).get("project") or {}
    if project.get("commit"):
        tags["mlflow.source.git.commit"] = project["commit"]  # the user's project, shown by MLflow's UI
        tags["hpc.project_dirty"] = str(bool(project.get("dirty")))
    return tags


def _newest_submission(rundir: RunDir) -> dict:
    records = sorted(rundir.record.glob("submit-*.json"))
    try:
        return json.loads(records[-1].read_text()) if records else {}
    except (OSError, ValueError):
        return {}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def open_tracker(cfg, env, rundir: RunDir, comm) -> Tracker | None:
    """Rank 0's tracker (None elsewhere, or with tracking off). A store that cannot be written or a backend that is
    not installed is bad input, found before training (collective)."""
    import importlib.util

    from runconfig.load import to_dict
    from runconfig.tracking import flat_params, resolve, store_problem
    from trainer.env import agree

    target = resolve(cfg.tracking, rundir, dict(env.tracking_vars))
    problem = None
    if target is not None and env.rank == 0:
        module = "wandb" if target.backend == "wandb" else "mlflow"
        if importlib.util.find_spec(module) is None:
            package = "wandb" if module == "wandb" else "mlflow-skinny sqlalchemy alembic"
            problem = f"tracking.backend {target.backend} needs the {module} package: pip install {package}"
        elif (why := store_problem(target)) is not None:
            problem = f"tracking: the store {target.uri} cannot be written: {why}"
        if problem:
            problem += " (or set tracking.backend: off)"
    agree(comm, problem)
    if target is None or env.rank != 0:
        return None
    return Tracker(target, rundir, flat_params(to_dict(cfg)), cfg.tracking.flush_timeout_s)
