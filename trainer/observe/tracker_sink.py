"""Rank 0's experiment tracker: its records, its checkpoints' commits and the launch's end, handed to the
tracker's sender (trainer/observe/tracker_agent.py, a process of its own at the lowest CPU priority) through a
pipe. The training loop only formats a line into a buffer (``write``: tens of microseconds); the buffer goes to the
pipe, without blocking, when a checkpoint commits (what the pipe cannot take yet stays in the buffer). What is sent
when, and the one value per step across restarts, is the sender's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from rundir.contract import launches_and_restarts
from rundir.paths import RunDir, read_jsonl
from tracking import Target, TrackingState

log = logging.getLogger("trainer.tracking")
TRAINER_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the trainer package
FLUSH_BYTES = 1 << 20  # records held back at most (~1,500 records), then handed to the pipe anyway


class Tracker:
    def __init__(
        self,
        target: Target,
        rundir: RunDir,
        params: dict[str, str],
        flush_timeout_s: float,
        log_path: Path | None = None,
    ) -> None:
        self.target, self.rundir, self.flush_timeout_s = target, rundir, flush_timeout_s
        self.state = TrackingState.load(rundir.tracking, target)  # read here for the run's id only
        self._lock = threading.Lock()  # write() from the loop, committed() from an async save's thread
        self._buffer = bytearray()  # what the pipe could not take yet
        self._write_s, self._written, self._last_step = 0.0, 0, 0
        self._gone = False  # the pipe to the sender failed: nothing more is queued
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (str(TRAINER_ROOT), os.environ.get("PYTHONPATH")))),
        }
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.observe.tracker_agent"], stdin=subprocess.PIPE, env=env, close_fds=True
        )
        self._fd = self._proc.stdin.fileno()
        start = {"target": dataclasses.asdict(target), "run_dir": str(rundir.root), "params": params}
        self._send({"op": "start", **start, "log": str(log_path) if log_path else None})
        os.set_blocking(self._fd, False)

    @property
    def run_id(self) -> str | None:
        """The tracker run's id once the sender has it (tracking.json), for the checkpoint manifest."""
        if self.state.run_id is None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                self.state.run_id = json.loads(self.rundir.tracking.read_text()).get("run_id")
        return self.state.run_id

    def _send(self, op: dict, flush: bool = True) -> None:
        """Queue ``op``; with ``flush`` (or a full buffer) hand the queue to the pipe. Records are not flushed one
        by one: the sender needs them only once a checkpoint commits, and each write to the pipe wakes it."""
        if self._gone:
            return
        line = (json.dumps(op, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            self._buffer += line
            if not flush and len(self._buffer) < FLUSH_BYTES:
                return
            while self._buffer:
                try:
                    done = os.write(self._fd, self._buffer)
                except BlockingIOError:
                    return  # the pipe is full (the sender is busy): the next operation tries again
                except OSError as exc:  # the sender is gone (EPIPE) or its pipe is: tracking ends, training goes on
                    self._buffer.clear()
                    if not self._gone:
                        self._gone = True
                        log.warning("tracking: the tracker's sender is gone (%s); the run goes on untracked", exc)
                    return
                del self._buffer[:done]

    def begin(self, step: int, tags: dict[str, str], files: list[tuple[Path, str | None]]) -> None:
        self._send({"op": "begin", "step": step, "tags": tags, "files": [[str(p), f] for p, f in files]})

    def write(self, record: dict) -> None:
        began = time.perf_counter()
        self._send({"op": "record", "record": record}, flush=False)
        self._write_s += time.perf_counter() - began
        self._written += 1
        self._last_step = record["step"]

    def committed(self, step: int) -> None:
        self._send({"op": "committed", "step": step})

    def tags(self, tags: dict[str, str]) -> None:
        self._send({"op": "tags", "tags": tags})

    def file(self, path: Path, folder: str | None = None) -> None:
        self._send({"op": "file", "path": str(path), "folder": folder})

    def finish(self, how: str) -> None:
        self._send({"op": "finish", "how": how})

    def close(self) -> None:
        """End of input for the sender; wait up to tracking.flush_timeout_s for it to send what is queued, then end
        it; what it did not send is named (the next launch or `hpc report` sends it)."""
        deadline = time.monotonic() + self.flush_timeout_s
        os.set_blocking(self._fd, True)
        with contextlib.suppress(OSError), self._lock:
            while self._buffer:
                del self._buffer[: os.write(self._fd, self._buffer)]
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        try:
            self._proc.wait(max(0.0, deadline - time.monotonic()))
            late = False
        except subprocess.TimeoutExpired:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            late = True
        state = TrackingState.load(self.rundir.tracking, self.target)
        state.cost = {**state.cost, "write_us_per_record": 1e6 * self._write_s / max(1, self._written)}
        if late and self._last_step > state.sent_through:
            state.unsent = [state.sent_through + 1, self._last_step]
        with contextlib.suppress(OSError):
            state.save(self.rundir.tracking)
        if late:
            gap = f"steps {state.sent_through + 1}..{self._last_step} not sent; " if state.unsent else ""
            log.warning(
                "tracking: %s did not take the queue within tracking.flush_timeout_s=%g s: %sthe next launch or "
                "`python -m hpc report %s` sends them",
                self.target.shown,
                self.flush_timeout_s,
                gap,
                self.rundir.root,
            )


def launch_tags(cfg, env, layout: dict, launch_record: dict | None, rundir: RunDir, code_sha256: str | None) -> dict:
    """What identifies this launch in the tracker: Slurm ids, restarts, world and layout, hosts, code, versions."""
    from trainer.checkpoint.provenance import git_commit

    launches, restarts = launches_and_restarts(read_jsonl(rundir.history))
    tags = {
        "hpc.state": "running",
        "hpc.launch": env.launch_id,
        "hpc.launches": str(launches),
        "hpc.restarts": str(restarts),
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


def open_tracker(cfg, env, rundir: RunDir, comm) -> Tracker | None:
    """Rank 0's tracker (None elsewhere, or with tracking off). A store that cannot be written or a backend that is
    not installed is bad input, found before training (collective)."""
    import importlib.util

    from runconfig.load import to_dict
    from tracking import flat_params, resolve, store_problem
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
    try:
        return Tracker(target, rundir, flat_params(to_dict(cfg)), cfg.tracking.flush_timeout_s, rundir.rank_log(0))
    except OSError as exc:  # rank 0 alone: the others are past the agreement, so this must not end the run
        log.warning("tracking: the tracker's sender did not start (%s); the run goes on untracked", exc)
        return None
