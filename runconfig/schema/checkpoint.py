"""When checkpoints are committed and kept, the stop signals, resume, and storage retries."""

from __future__ import annotations

import re
from dataclasses import dataclass

from runconfig.schema.fields import Problems, Range, Section, doc
from runconfig.schema.slurm_syntax import SIGNAL_NAMES

# scheme://bucket/prefix on one line (no whitespace or control characters: it is logged and passed to fsspec)
STORAGE_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^/\s][^\s]*")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(Section):
    every_steps: int = doc(
        "Commit a checkpoint every N optimizer steps; 0 = not by step count.", 100, bounds=Range(ge=0)
    )
    every_minutes: float = doc(
        "Commit a checkpoint when this many minutes passed since the last; 0 = off.", 0.0, bounds=Range(ge=0)
    )
    keep_last: int = doc(
        "Committed generations kept (>= 2); older ones are pruned after a newer commit.",
        2,
        bounds=Range(ge=2, text=">= 2 (never keep only one generation)"),
    )
    storage: str | None = doc(
        "Object storage for the checkpoints, e.g. s3://bucket/runs/NAME (storage: for the endpoint; credentials from "
        "the environment): every generation is committed in the run directory first, then uploaded, each rank its "
        "share, its manifest last; the run directory keeps checkpoint.keep_local of them. A start with no newer "
        "local generation downloads the newest one from there. Unset: the run directory only.",
        None,
    )
    keep_local: int = doc(
        "With checkpoint.storage: committed generations kept in the run directory once uploaded (the bucket keeps "
        "checkpoint.keep_last).",
        1,
        bounds=Range(ge=1),
    )
    memory_every_steps: int = doc(
        "Also keep a checkpoint in node memory every N optimizer steps (checkpoint.memory_dir), each rank's files "
        "copied to a rank on the next node: a restart in the job resumes from the newest one every rank can reach "
        "(its own node's copy or the partner's), losing at most N steps, else from the durable checkpoint. The two "
        "newest are kept; all are removed when the run's launcher ends. 0 = off.",
        0,
        bounds=Range(ge=0),
    )
    memory_dir: str = doc(
        "Node-local memory (a tmpfs on each node) for checkpoint.memory_every_steps: the checkpoints go into the "
        "private folder hpc-UID/RUN_ID/NODE there. A generation that would fill more than half of its free space is "
        "not written (a warning says so).",
        "/dev/shm",
        nonempty="must name a folder",
    )
    keep_every: int = doc(
        "Also keep forever every checkpoint whose step is a multiple of this; 0 = none.", 0, bounds=Range(ge=0)
    )
    keep_best: int = doc(
        "Also keep the N generations with the best checkpoint.best_metric among those evaluated at their own step "
        "(train.eval_every), in the run directory and in checkpoint.storage; 0 = none. The newest committed "
        "generation is never pruned.",
        0,
        bounds=Range(ge=0),
    )
    best_metric: str = doc(
        "The eval metric checkpoint.keep_best ranks by: eval_loss, or eval_<name> of a recipe's eval_metrics.",
        "eval_loss",
        nonempty="must name an eval metric",
    )
    best_mode: str = doc("Whether a lower (min) or a higher (max) checkpoint.best_metric is better.", "min",
                         choices=("min", "max"))  # fmt: skip
    async_save: bool = doc("Copy the state to CPU memory and write it in the background while training goes on.", False)
    at_end: bool = doc("Commit a checkpoint when training completes.", True)
    stop_signals: list[str] = doc(
        "Signals that stop training at the next step boundary with a committed checkpoint (exit status 75: "
        "stopped, resumable). SIGUSR1 is left out by default: NCCL uses it on some systems.",
        factory=lambda: ["SIGUSR2", "SIGTERM"],
    )
    resume: bool = doc("Continue from the newest valid checkpoint in the run directory when there is one.", True)
    allow_shape_change: bool = doc(
        "Resume even if the model or optimizer config changed since the checkpoint (a warm start: parameters "
        "whose name and shape still match are loaded, the others keep their fresh initialisation, and the "
        "optimizer state is reset unless every parameter loaded). A dropout change never needs it.",
        False,
    )
    io_retries: int = doc(
        "Further attempts at a checkpoint save or load whose file I/O failed with a transient storage error (EIO, "
        "ESTALE, ETIMEDOUT, ...: a network file system's fail-over). A save is retried whole, on every rank, from a "
        "fresh temporary folder; the previous generation is never touched. Then the launch fails as a crash and is "
        "restarted (job.max_failures). A full disk or a permission error is not retried; 0 = no retries.",
        5,
        bounds=Range(ge=0),
    )
    io_retry_backoff_s: float = doc(
        "Seconds before the first retry of a checkpoint save or load; each next one waits twice as long (at most "
        "30 s, with jitter), and no retry starts later than 120 s after the first attempt.",
        1.0,
        bounds=Range(gt=0, le=60, text="in (0, 60] seconds"),
    )

    def relations(self) -> Problems:
        out: Problems = [
            ("stop_signals", f"{name!r} is not one of {', '.join(SIGNAL_NAMES)}")
            for name in self.stop_signals
            if name not in SIGNAL_NAMES
        ]
        if self.keep_best and not self.best_metric.startswith("eval_"):
            out.append(("best_metric", f"must be eval_loss or eval_<metric>, got {self.best_metric!r}"))
        if self.storage is not None and not STORAGE_RE.fullmatch(self.storage):
            out.append(("storage", f"must be an object-storage URL such as s3://bucket/prefix, got {self.storage!r} "
                        "(unset it to keep the checkpoints in the run directory)"))  # fmt: skip
        if not self.memory_dir.startswith("/"):
            out.append(("memory_dir", f"must be an absolute path (each node's own), got {self.memory_dir!r}"))
        return out
