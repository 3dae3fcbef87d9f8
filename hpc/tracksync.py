"""The tracker caught up from the login node (``python -m hpc report`` calls it; torch-free).

What the trainer could not send (a tracker that was down when a launch ended) is in metrics.jsonl: the steps a
committed checkpoint covers, or every step of a completed run, after the tracker's ``sent_through``. They are sent
only while no launch sends (the run's tracking lock, and no job of the run active), so that no step goes twice;
the report's files are sent in any case (a file sent again replaces itself).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from runconfig import load_config
from rundir import RunDir
from rundir.checkpoints import latest_committed
from rundir.paths import read_jsonl
from tracking import (
    ARTIFACTS_NAME,
    TrackingState,
    client_environment,
    flat_params,
    hold_lock,
    open_backend,
    pick,
    reconcile,
    resolve,
    send,
)

BATCH_RECORDS = 2000


def sync(
    rundir: RunDir,
    files: list[tuple[Path, str | None]],
    *,
    idle: bool,
    metrics: tuple[dict[str, float], int, dict[str, str]] | None = None,
) -> str | None:
    """Send the report's ``files`` and ``metrics`` (values, at a step, with tags: the cost and the goodput split,
    keys no launch sends) and, when ``idle`` (no job of the run is active) and no launch holds the run's
    tracking lock, the steps the tracker lacks. The store is the one tracking.json names (the run's own, whatever
    this login node's environment says); a run without tracking.json was never tracked: None. One line saying what
    was sent; MLflow only (W&B offline files are the trainer's). Raises what the tracker's client raises."""
    if not rundir.tracking.is_file():
        return None
    cfg = load_config(str(rundir.config))
    target = resolve(cfg.tracking, rundir, os.environ)
    lock = hold_lock(rundir, wait=False) if idle else None
    try:
        if target is None:
            target = resolve(dataclasses.replace(cfg.tracking, backend="mlflow"), rundir, os.environ)
        data = json.loads(rundir.tracking.read_text())
        if data.get("backend") != "mlflow":
            return None
        target = dataclasses.replace(target, uri=data["uri"])
        if target.store_path is not None:
            target = dataclasses.replace(target, artifact_location=str(target.store_path.parent / ARTIFACTS_NAME))
        state = TrackingState.load(rundir.tracking, target)
        if lock is None and state.run_id is None:
            return f"tracker: {target.uri}: the run is being tracked by its running launch; nothing sent"
        client_environment(target)
        backend = open_backend(target)
        done = rundir.summary.is_file()
        sent = 0
        if lock is None:  # a launch sends: only the report's files go, and tracking.json is the launch's
            backend.open(dataclasses.replace(state), {}, running=False)
        else:
            backend.open(state, {"hpc.run_dir": str(rundir.root)}, running=False)
            state.save(rundir.tracking)
            if reconcile(backend, state):
                state.save(rundir.tracking)
            if not state.params_logged:
                from runconfig.load import to_dict

                backend.params(state.run_id, flat_params(to_dict(cfg)))
                state.params_logged = True
            newest = latest_committed(rundir.checkpoints)
            through = 1 << 62 if done else int((newest or {}).get("step", 0))
            records = [r for r in read_jsonl(rundir.metrics) if isinstance(r.get("step"), int) and r["step"] <= through]
            while batch := pick(records, state.sent_through, BATCH_RECORDS):
                send(backend, state, batch, lambda: state.save(rundir.tracking))
                sent += len(batch)
            state.unsent = []
            state.save(rundir.tracking)
            if done:
                backend.end(state.run_id, "FINISHED")
        for path, folder in files:
            backend.artifact(state.run_id, path, folder)
        if metrics is not None:
            values, step, tags = metrics
            now_ms = int(time.time() * 1000)
            backend.metrics(state.run_id, [(key, value, step, now_ms) for key, value in values.items()])
            backend.tags(state.run_id, tags)
        caught = f", {sent} step record(s) it lacked" if sent else ""
        busy = "" if lock is not None else " (steps left to the running launch)"
        return f"tracker: {target.uri} run {state.run_id}: the report's {len(files)} file(s){caught}{busy}"
    finally:
        if lock is not None:
            lock.close()
