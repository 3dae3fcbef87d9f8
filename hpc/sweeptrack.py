"""A sweep in the tracker: a parent run (made by `hpc sweep` on the login node) whose children are the elements'
runs (each element's rank 0 finds it in SWEEP_DIR/tracking.json and tags its own run with it), finished with the
results table once every element has ended. MLflow only; a tracker that cannot be reached costs a warning."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from runconfig import RunConfig
from rundir import RunDir
from tracking import TrackingState, client_environment, open_backend, resolve


def _target(sweep_dir: Path, cfg: RunConfig):
    """The elements' tracker (resolved as for an element: the store beside the elements is the sweep folder's)."""
    target = resolve(cfg.tracking, RunDir(sweep_dir / "element"), os.environ)
    return target if target is not None and target.backend == "mlflow" else None


def open_parent(sweep_dir: Path, cfg: RunConfig, spec: dict, keys: list[str]) -> str | None:
    """Make the sweep's parent run; its id (None when not tracked, or the tracker refused: warned)."""
    target = _target(sweep_dir, cfg)
    if target is None:
        return None
    import dataclasses

    target = dataclasses.replace(target, run_name=sweep_dir.name)
    state = TrackingState(target.backend, target.uri)
    try:
        client_environment(target)
        backend = open_backend(target)
        backend.open(state, {"hpc.sweep": str(sweep_dir), "hpc.state": "running"})
        params = {f"sweep.{k}": json.dumps(v) if not isinstance(v, str) else v for k, v in spec.items()}
        backend.params(state.run_id, {**params, "sweep.keys": ",".join(keys)})
        state.params_logged = True
        state.save(RunDir(sweep_dir).tracking)
    except Exception as exc:
        print(f"warning: the sweep's parent run was not made in {target.uri}: {exc}", file=sys.stderr)
        return None
    return state.run_id


def finish_parent(sweep_dir: Path, rows: list[dict]) -> str | None:
    """The results (markdown and JSON) as the parent's artifacts, its best value as a metric, status FINISHED."""
    path = RunDir(sweep_dir).tracking
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    from runconfig import load_config
    from tracking import Target

    spec = json.loads((sweep_dir / "sweep_spec.json").read_text())
    metric = spec.get("metric", "eval_loss")
    first = json.loads((sweep_dir / "sweep.json").read_text())[0]["run_dir"]
    cfg = load_config(str(Path(first) / "config.yaml"))
    target = _target(sweep_dir, cfg) or Target("mlflow", data["uri"], cfg.tracking.experiment, sweep_dir.name)
    try:
        backend = open_backend(target)
        best = next((r[metric] for r in rows if r.get(metric) is not None), None)
        if best is not None:
            backend.metrics(data["run_id"], [(f"best_{metric}", float(best), 0, 0)])
        states = {s: sum(1 for r in rows if r["state"] == s) for s in {r["state"] for r in rows}}
        backend.tags(data["run_id"], {"hpc.state": "done", **{f"hpc.elements.{s}": str(n) for s, n in states.items()}})
        for name in ("results.md", "results.json"):
            backend.artifact(data["run_id"], sweep_dir / name)
        backend.end(data["run_id"], "FINISHED")
    except Exception as exc:
        return f"warning: the sweep's parent run was not finished in {data['uri']}: {exc}"
    return f"tracker: the sweep's parent run {data['run_id']} in {data['uri']}"
