"""Where a run is tracked: tracking.* and the environment -> a `Target` (backend, URI, artifact location), or
None when off; whether an embedded store can be written."""

from __future__ import annotations

import contextlib
import getpass
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from runconfig.schema.tracking import TrackingConfig
from rundir.paths import RunDir
from storage.private import UnsafeFolder, private_dir

TRACKING_VAR = "HPC_TRACKING"  # "off": tracking.backend auto tracks nothing (CI, test suites)


MLFLOW_URI_VAR = "MLFLOW_TRACKING_URI"


STORE_NAME = "mlflow.db"  # the embedded store, beside the run directory


ARTIFACTS_NAME = "mlartifacts"


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
    uri = cfg.uri or environ.get(MLFLOW_URI_VAR) or str(default_store(rundir.root.parent))
    if uri.startswith("file:///"):
        uri = uri.removeprefix("file://")
    if uri.startswith("/"):
        uri = f"sqlite:///{uri}"
    artifacts = None
    if uri.startswith("sqlite:///"):
        artifacts = str(Path(uri.removeprefix("sqlite:///")).parent / ARTIFACTS_NAME)
    return Target("mlflow", uri, cfg.experiment, name, artifacts)


def default_store(runs: Path) -> Path:
    """The embedded store of the runs in ``runs``: beside them where the folder is this user's and no one else may
    write it; else in a folder of the user's own there (``.mlflow-USER``, made private when the store is checked):
    in a shared runs folder another user's store, or a link they put in its place, is never written."""
    try:
        st = os.stat(runs)
        shared = st.st_uid != os.geteuid() or st.st_mode & 0o022
    except OSError:
        shared = False  # made by this user when the store is
    return runs / f".mlflow-{getpass.getuser()}" / STORE_NAME if shared else runs / STORE_NAME


def store_problem(target: Target) -> str | None:
    """Why an embedded store cannot be written (checked before training), or None."""
    path = target.store_path if target.backend == "mlflow" else Path(target.uri)
    if path is None:
        return None
    folder = path if target.backend == "wandb" else path.parent
    if folder.name.startswith(".mlflow-"):  # default_store's own folder in a shared runs folder
        try:
            private_dir(folder, what="tracking: the folder of your embedded store")
        except UnsafeFolder as exc:
            return str(exc)
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
    if os.path.islink(path) or (path.exists() and path.stat().st_uid != os.geteuid()):
        return f"{path} is a link or another user's file: an embedded store is never one someone else can swap"
    if not folder.is_dir():
        return f"the folder {folder} does not exist and cannot be made"
    probe = path if path.is_file() else folder / f".hpc-write-probe-{os.getpid()}"
    try:  # a real write: root passes every mode check, a read-only mount does not; never through a link
        flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | (0 if probe == path else os.O_CREAT | os.O_EXCL)
        os.close(os.open(probe, flags, 0o600))
        if probe != path:
            probe.unlink()
    except OSError as exc:
        return f"{probe if probe == path else folder} is not writable ({exc.strerror or exc})"
    return None


def is_sweep(folder: Path) -> bool:
    """A folder `hpc sweep` made (its elements' run directories are inside)."""
    return (folder / "sweep.json").exists()
