"""Experiment tracking: MLflow (an embedded SQLite store by default, or a server) or W&B offline, from rank 0."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from runconfig.schema.fields import Problems, Range, Section, doc

URI_RE = re.compile(r"^(https?://[A-Za-z0-9.\-\[\]:]+(/[^\s@]*)?|sqlite:///.+|/.+|file:///.+)$")


@dataclass(frozen=True, kw_only=True)
class TrackingConfig(Section):
    backend: Literal["auto", "mlflow", "wandb", "off", False] = doc(
        "Where rank 0 tracks the run: 'mlflow', 'wandb' (W&B in offline mode, files under RUN_DIR/wandb for `wandb "
        "sync`), 'off', or 'auto': mlflow, unless the environment says HPC_TRACKING=off (CI, test suites). One "
        "tracker run per run directory, kept across requeues, restarts, chains and resumes (RUN_DIR/tracking.json). "
        "(YAML reads a bare off as false: the same.)",
        "auto",
    )
    uri: str | None = doc(
        "MLflow tracking URI: http(s)://host:port of an MLflow server, or a SQLite store (sqlite:////abs/path.db or "
        "an absolute path ending in .db). Unset: $MLFLOW_TRACKING_URI, else an embedded store beside the run "
        "directory (RUN_DIR/../mlflow.db, artifacts in RUN_DIR/../mlartifacts; `mlflow ui --backend-store-uri "
        "sqlite:///...` shows it). Credentials never go here: MLFLOW_TRACKING_TOKEN or _USERNAME/_PASSWORD come "
        "from the environment.",
        None,
    )
    experiment: str = doc(
        "The MLflow experiment (W&B project) the run belongs to; created when missing.", "hpc-trainer"
    )
    run_name: str | None = doc("The tracker run's name; unset: the run directory's name.", None)
    flush_timeout_s: float = doc(
        "At the end of a launch, seconds rank 0 waits for the tracker to take what is still queued; what it did not "
        "take is sent by the next launch or by `python -m hpc report RUN_DIR`, and the report says so.",
        20.0,
        bounds=Range(ge=0),
    )

    def relations(self) -> Problems:
        uri = self.uri
        if uri is None:
            return []
        if "@" in uri.split("//", 1)[-1].split("/", 1)[0]:
            return [("uri", "holds credentials (user:password@): they go in MLFLOW_TRACKING_USERNAME/PASSWORD")]
        if not URI_RE.fullmatch(uri):
            return [("uri", f"must be an http(s):// URL of an MLflow server or a SQLite store path, got {uri!r}")]
        if uri.startswith("/") and not uri.endswith(".db"):
            return [("uri", f"{uri!r}: a store path must end in .db (a SQLite file), or use sqlite:////...")]
        return []
