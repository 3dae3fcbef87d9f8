"""The tracker clients behind one small interface: MLflow's client (and its embedded SQLite store, made whole or
not at all) and W&B in offline mode."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from tracking.state import PARAM_CHARS, TrackingState
from tracking.target import ARTIFACTS_NAME, Target

PARAMS_PER_BATCH, TAGS_PER_BATCH, METRICS_PER_BATCH = 100, 100, 1000  # MLflow's log_batch limits


log = logging.getLogger(__name__)


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

    lock_fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(lock_fd) as lock:
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
