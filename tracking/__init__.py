"""Experiment tracking (torch-free: the trainer's rank 0 and ``python -m hpc report`` both send through it):
``target`` where a run is tracked, ``state`` what its tracker holds and the rule of sending a step once,
``backends`` MLflow and W&B offline behind one small interface."""

from tracking.backends import MlflowBackend, WandbBackend, client_environment, create_store, open_backend
from tracking.state import (
    LAST_KEY,
    TrackingState,
    flat_params,
    hold_lock,
    metric_points,
    parent_of,
    pick,
    reconcile,
    send,
)
from tracking.target import (
    ARTIFACTS_NAME,
    MLFLOW_URI_VAR,
    STORE_NAME,
    TRACKING_VAR,
    Target,
    is_sweep,
    resolve,
    store_problem,
)

__all__ = [
    "ARTIFACTS_NAME",
    "LAST_KEY",
    "MLFLOW_URI_VAR",
    "STORE_NAME",
    "TRACKING_VAR",
    "MlflowBackend",
    "Target",
    "TrackingState",
    "WandbBackend",
    "client_environment",
    "create_store",
    "flat_params",
    "hold_lock",
    "is_sweep",
    "metric_points",
    "open_backend",
    "parent_of",
    "pick",
    "reconcile",
    "resolve",
    "send",
    "store_problem",
]
