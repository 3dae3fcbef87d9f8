"""Where a run is tracked and how (torch-free: the trainer's rank 0 and ``python -m hpc report`` both send).

- ``resolve``: tracking.* and the environment -> a ``Target`` (backend, URI, artifact location), or None when off.
- ``TrackingState``: RUN_DIR/tracking.json, the tracker run's id and ``sent_through``, the last step whose metrics
  the tracker holds. A step is sent once: the trainer sends a step's record only when a committed checkpoint covers
  it (or the run is done), so a resume never recomputes a step the tracker has; ``in_flight_through`` marks a batch
  being sent, so that a process killed before it saved ``sent_through`` is looked up rather than sent twice.
- ``metric_points``: a metrics.jsonl record -> (key, value, step, milliseconds) for every finite number in it.
- ``MlflowBackend`` and ``WandbBackend``: the same small interface over MLflow's client and W&B in offline mode.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runconfig.rundir import RunDir
from runconfig.schema.tracking import TrackingConfig

TRACKING_VAR = "HPC_TRACKING"  # "off": tracking.backend auto tracks nothing (CI, test suites)
MLFLOW_URI_VAR = "MLFLOW_TRACKING_URI"
LOCK_NAME = ".tracking.lock"  # held by the launch that sends (rank 0), so that a report does not send beside it
STORE_NAME = "mlflow.db"  # the embedded store, beside the run directory
ARTIFACTS_NAME = "mlartifacts"
# metrics.jsonl fields that are not metrics (the step is the x axis; the rest are labels or clocks)
NOT_METRICS = frozenset({"step", "time", "launch", "unit", "comm_by_dim", "stragglers"})
PARAMS_PER_BATCH, TAGS_PER_BATCH, METRICS_PER_BATCH = 100, 100, 1000  # MLflow's log_batch limits
PARAM_CHARS = 6000  # MLflow's longest parameter value
LAST_KEY = "step_time_s"  # in every record, sent last of each

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    backend: str  # "mlflow" or "wandb"
    uri: str  # MLflow's tracking URI; W&B: the folder its offline files go to
    experiment: str
    run_name: str
    artifact_location: str | None = None  # an embedded store's artifact folder (a server keeps its own)
    group: str | None = None  # W&B: a sweep element's group, the sweep's folder name (MLflow: a parent run)

    @property
    def store_path(self) -> Path | None:
        """The SQLite file of an embedded MLflow store."""
        return Path(self.uri.removeprefix("sqlite:///")) if self.uri.startswith("sqlite:///") else None

    @property
    def shown(self) -> str:
        return f"{self.backend} {self.uri}"


def resolve(cfg: TrackingConfig, rundir: RunDir, environ: Mapping[str, str]) -> Target | None:
    backend = cfg.backend or "off"  # YAML's bare off is False
    if backend == "auto":
        backend = "off" if environ.get(TRACKING_VAR, "").strip().lower() in ("off", "0", "false", "no") else "mlflow"
    if backend == "off":
        return None
    name = cfg.run_name or rundir.root.name
    if backend == "wandb":
        sweep = rundir.root.parent
        return Target("wandb", str(rundir.root), cfg.experiment, name, group=sweep.name if is_sweep(sweep) else None)
    uri = cfg.uri or environ.get(MLFLOW_URI_VAR) or str(rundir.root.parent / STORE_NAME)
    if uri.startswith("file:///"):
        uri = uri.removeprefix("file://")
    if uri.startswith("/"):
        uri = f"sqlite:///{uri}"
    artifacts = None
    if uri.startswith("sqlite:///"):
        artifacts = str(Path(uri.removeprefix("sqlite:///")).parent / ARTIFACTS_NAME)
    return Target("mlflow", uri, cfg.experiment, name, artifacts)


def store_problem(target: Target) -> str | None:
    """Why an embedded store cannot be written (checked before training), or None."""
    path = target.store_path if target.backend == "mlflow" else Path(target.uri)
    if path is None:
        return None
    folder = path if target.backend == "wandb" else path.parent
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
    if not folder.is_dir():
        return f"the folder {folder} does not exist and cannot be made"
    probe = path if path.is_file() else folder / f".hpc-write-probe-{os.getpid()}"
    try:  # a real write: root passes every mode check, a read-only mount does not
        with open(probe, "a"):
            pass
        if probe != path:
            probe.unlink()
    except OSError as exc:
        return f"{probe if probe == path else folder} is not writable ({exc.strerror or exc})"
    return None


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
        tmp = Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}-{threading.get_native_id()}")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, path)


def is_sweep(folder: Path) -> bool:
    """A folder `hpc sweep` made (its elements' run directories are inside)."""
    return (folder / "sweep.json").exists()


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
        f = open(rundir.root / LOCK_NAME, "a")  # noqa: SIM115 (held as long as the caller keeps it)
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


def flat_params(data: object) -> dict[str, str]:
    """A config as MLflow parameters: dotted keys, JSON values (cut at MLflow's length)."""
    from runconfig.load import flatten

    out = {}
    for key, value in flatten(data).items():
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        out[key] = text[:PARAM_CHARS]
    return out


def _quiet(*names: str) -> None:
    for name in names:
        logging.getLogger(name).setLevel(logging.WARNING)


def create_store(target: Target) -> None:
    """Make a missing embedded store whole or not at all: its tables (alembic's migrations, seconds of CPU) are
    made in a file of this process's own, then renamed into place, under a lock beside the store (several runs of a
    sweep may start at once). A process killed part-way (its launch ended first) leaves only that file behind,
    never a half-migrated store that no later opener can migrate."""
    import fcntl

    path = target.store_path
    if path is None or (path.exists() and path.stat().st_size > 0):
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process is killed
        if path.exists() and path.stat().st_size > 0:  # made by another run meanwhile
            return
        for stale in path.parent.glob(f".{path.name}.creating-*"):  # what killed creators left
            with contextlib.suppress(OSError):
                stale.unlink()
        tmp = path.with_name(f".{path.name}.creating-{os.getpid()}")
        try:
            store = SqlAlchemyStore(f"sqlite:///{tmp}", target.artifact_location or str(path.parent / ARTIFACTS_NAME))
            store.engine.dispose()
            os.replace(tmp, path)  # over nothing, or over an empty file (a write probe's, an older release's)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()


class MlflowBackend:
    """MLflow's client on ``target.uri``: one call per batch (log_batch), nothing global (no active run)."""

    def __init__(self, target: Target) -> None:
        _quiet("alembic")
        from mlflow.tracking import MlflowClient

        create_store(target)
        self.target = target
        self.client = MlflowClient(tracking_uri=target.uri)

    def open(self, state: TrackingState, tags: dict[str, str], running: bool = True) -> None:
        """The state's run (made when it has none): ``state.run_id`` and ``experiment_id`` set; marked RUNNING
        unless ``running`` is false (a report sent from the login node)."""
        if state.run_id is not None:
            run = self.client.get_run(state.run_id)  # raises when the store lost it
            state.experiment_id = run.info.experiment_id
            if running:
                self.client.update_run(state.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(self.target.experiment)
        if experiment is None:
            try:
                experiment_id = self.client.create_experiment(
                    self.target.experiment, artifact_location=self._artifact_uri()
                )
            except Exception:  # made meanwhile by another run of the sweep
                experiment = self.client.get_experiment_by_name(self.target.experiment)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        else:
            experiment_id = experiment.experiment_id
        run = self.client.create_run(experiment_id, run_name=self.target.run_name, tags=tags)
        state.run_id, state.experiment_id = run.info.run_id, experiment_id

    def _artifact_uri(self) -> str | None:
        location = self.target.artifact_location
        return Path(location).as_uri() if location else None

    def params(self, run_id: str, params: dict[str, str]) -> dict[str, str]:
        """Log the params the run does not have yet; those it has with another value are returned (MLflow's
        params cannot change: the caller tags them)."""
        from mlflow.entities import Param

        have = self.client.get_run(run_id).data.params
        new = [Param(k, v) for k, v in params.items() if k not in have]
        for i in range(0, len(new), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=new[i : i + PARAMS_PER_BATCH])
        return {k: v for k, v in params.items() if k in have and have[k] != v}

    def tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:PARAM_CHARS]) for k, v in tags.items()]
        for i in range(0, len(items), TAGS_PER_BATCH):
            self.client.log_batch(run_id, tags=items[i : i + TAGS_PER_BATCH])

    def metrics(self, run_id: str, points: list[tuple[str, float, int, int]]) -> None:
        from mlflow.entities import Metric

        items = [Metric(key, value, ms, step) for key, value, step, ms in points]
        for i in range(0, len(items), METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=items[i : i + METRICS_PER_BATCH])

    def last_step(self, run_id: str, key: str) -> int:
        """The highest step the run holds for ``key`` (0 without one)."""
        return max((m.step for m in self.client.get_metric_history(run_id, key)), default=0)

    def artifact(self, run_id: str, path: Path, folder: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), folder)

    def end(self, run_id: str, status: str) -> None:
        """status: FINISHED, KILLED (stopped, to be continued) or FAILED."""
        self.client.set_terminated(run_id, status)


class WandbBackend:
    """W&B in offline mode: files under ``target.uri``/wandb that `wandb sync` uploads; the run id is W&B's own
    (resumed offline, each launch writes a folder of its own that `wandb sync` merges into the one run)."""

    def __init__(self, target: Target) -> None:
        import wandb

        self.wandb, self.target, self.run, self.all_tags = wandb, target, None, {}

    def open(self, state: TrackingState, tags: dict[str, str], running: bool = True) -> None:
        import uuid

        run_id = state.run_id or uuid.uuid4().hex[:12]  # W&B's ids: letters and digits; offline, ours
        self.run = self.wandb.init(
            project=self.target.experiment,
            name=self.target.run_name,
            id=run_id,
            group=self.target.group,  # a sweep's elements side by side in W&B's grouping
            resume="allow",
            dir=self.target.uri,
            mode="offline",
            config={"tags": dict(tags)},
            settings=self.wandb.Settings(console="off", x_disable_stats=True),
        )
        state.run_id, state.experiment_id = run_id, self.target.experiment
        self.all_tags.update(tags)

    def params(self, run_id: str, params: dict[str, str]) -> dict[str, str]:
        self.run.config.update({"config": params}, allow_val_change=True)
        return {}

    def tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.all_tags.update(tags)  # W&B's config holds one value per key: the launch's tags and later ones
        self.run.config.update({"tags": dict(self.all_tags)}, allow_val_change=True)

    def metrics(self, run_id: str, points: list[tuple[str, float, int, int]]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for key, value, step, _ in points:
            by_step.setdefault(step, {})[key] = value
        for step in sorted(by_step):
            self.run.log(by_step[step], step=step)

    def last_step(self, run_id: str, key: str) -> int:
        return 0  # offline files cannot be asked; a batch in flight at a kill is sent again

    def artifact(self, run_id: str, path: Path, folder: str | None = None) -> None:
        self.run.save(str(path), base_path=str(Path(path).parent), policy="now")

    def end(self, run_id: str, status: str) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=0 if status == "FINISHED" else 1)


def client_environment(target: Target) -> None:
    """The clients' settings, made in the main thread before a backend is opened in another (setenv beside a
    thread's getenv is not safe). Failures are retried by the caller, which must see them in seconds, not after
    MLflow's own minutes of retries; MLflow's INFO lines about its store's tables are not the run's."""
    if target.backend == "mlflow":
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    else:
        os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")


def open_backend(target: Target) -> MlflowBackend | WandbBackend:
    return WandbBackend(target) if target.backend == "wandb" else MlflowBackend(target)
