"""What a run has sent its tracker: RUN_DIR/tracking.json (`TrackingState`: the tracker run, `sent_through`, the
last step whose metrics the tracker holds) and the rules of sending a step once.

The trainer sends a step's record only when a committed checkpoint covers it (or the run is done), so a resume never
recomputes a step the tracker has; `in_flight_through` marks a batch being sent, so that a process killed before it
saved `sent_through` is looked up rather than sent twice."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rundir.paths import RunDir
from storage.files import write_json_atomic
from tracking.target import Target, is_sweep

# metrics.jsonl fields that are not metrics (the step is the x axis; the rest are labels or clocks)
NOT_METRICS = frozenset({"step", "time", "launch", "unit", "comm_by_dim", "stragglers"})


PARAM_CHARS = 6000  # MLflow's longest parameter value


LAST_KEY = "step_time_s"  # in every record, sent last of each


@dataclass
class TrackingState:
    backend: str
    uri: str
    run_id: str | None = None
    experiment_id: str | None = None
    sent_through: int = 0  # the tracker holds the metrics of every step up to this one
    in_flight_through: int = 0  # a batch up to this step was being sent (> sent_through: look it up first)
    params_logged: bool = False
    unsent: list[int] = field(default_factory=list)  # [first, last] steps committed but not sent at the last end
    cost: dict = field(default_factory=dict)  # the last launch's: write() per record, the thread's CPU seconds

    @classmethod
    def load(cls, path: Path, target: Target) -> TrackingState:
        """The run's state for ``target``; a fresh one when there is none or it names another store (the run then
        starts a tracker run there and sends it the whole history)."""
        try:
            data = json.loads(Path(path).read_text())
            state = cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        except (OSError, ValueError, TypeError, AttributeError):  # missing, torn, or not an object
            return cls(target.backend, target.uri)
        if (state.backend, state.uri) != (target.backend, target.uri):
            return cls(target.backend, target.uri)
        return state

    def save(self, path: Path) -> None:
        write_json_atomic(path, asdict(self), fsync=False, indent=1)


def parent_of(rundir: RunDir, target: Target) -> str | None:
    """The parent run of a sweep element (SWEEP_DIR/tracking.json, made by `hpc sweep`) in the same store."""
    try:
        data = json.loads(RunDir(rundir.root.parent).tracking.read_text())
    except (OSError, ValueError):
        return None
    same = (data.get("backend"), data.get("uri")) == (target.backend, target.uri)
    return data.get("run_id") if same and is_sweep(rundir.root.parent) else None


def hold_lock(rundir: RunDir, wait: bool):
    """The run's tracking lock (an open file holding an flock), or None when another process holds it."""
    import fcntl

    try:
        f = open(rundir.tracking_lock, "a")  # noqa: SIM115 (held as long as the caller keeps it)
    except OSError:
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def metric_points(record: dict) -> list[tuple[str, float, int, int]]:
    """(key, value, step, ms) of a metrics.jsonl record: its finite numbers, comm_by_dim's as comm_DIM_s."""
    step, ms = int(record["step"]), int(1000 * float(record.get("time") or 0))
    out = []
    items: Iterable = [(k, v) for k, v in record.items() if k not in NOT_METRICS]
    items = [*items, *((f"comm_{d}_s", v) for d, v in (record.get("comm_by_dim") or {}).items())]
    for key, value in items:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((key, float(value), step, ms))
    # step_time_s last: a record whose step_time_s the tracker holds was sent whole (reconcile looks it up)
    out.sort(key=lambda p: p[0] == LAST_KEY)
    return out


def pick(records: Iterable[dict], through: int, limit: int) -> list[dict]:
    """The records to send next: after step ``through``, in step order, the first of each step (a step can be in
    metrics.jsonl twice after a kill between truncate_metrics' two writes), at most ``limit``."""
    out, seen = [], set()
    for r in sorted((r for r in records if r["step"] > through), key=lambda r: r["step"]):
        if r["step"] not in seen and len(out) < limit:
            seen.add(r["step"])
            out.append(r)
    return out


def send(backend, state: TrackingState, batch: list[dict], save) -> None:
    """Send ``batch`` (from ``pick``): ``in_flight_through`` is saved first, ``sent_through`` once it is taken."""
    last = batch[-1]["step"]
    state.in_flight_through = last
    save()
    backend.metrics(state.run_id, [pt for r in batch for pt in metric_points(r)])
    state.sent_through = state.in_flight_through = last
    save()


def reconcile(backend, state: TrackingState) -> bool:
    """After a process was killed while sending: ``sent_through`` from what the tracker holds. Whether it changed."""
    if state.in_flight_through <= state.sent_through:
        return False
    held = backend.last_step(state.run_id, LAST_KEY)
    state.sent_through = max(state.sent_through, min(held, state.in_flight_through))
    state.in_flight_through = state.sent_through
    return True


ENV_PREFIX = "job.env."  # its values never become params


def flat_params(data: object) -> dict[str, str]:
    """A config as MLflow parameters: dotted keys, JSON values (cut at MLflow's length). job.env's values are left
    out (everyone on a shared tracking server reads the params): ``job.env`` lists the variables' names."""
    from runconfig.load import flatten

    out = {}
    env_names = []
    for key, value in flatten(data).items():
        if key.startswith(ENV_PREFIX):
            env_names.append(key[len(ENV_PREFIX) :])
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        out[key] = text[:PARAM_CHARS]
    if env_names:
        out[ENV_PREFIX.rstrip(".")] = json.dumps(sorted(env_names))[:PARAM_CHARS]
    return out
