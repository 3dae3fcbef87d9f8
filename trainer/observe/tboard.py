"""TensorBoard event files (rank 0): every metrics.jsonl record as scalars under RUN_DIR/tensorboard/."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# metrics.jsonl field -> TensorBoard tag
TAGS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
    "samples_per_s": "throughput/samples_per_s",
    "mfu": "throughput/mfu",
    "step_time_s": "time/step_s",
    "time_data_s": "time/data_wait_s",
    "time_compute_s": "time/forward_backward_s",
    "time_comm_s": "time/exposed_comm_s",
    "time_optim_s": "time/optimizer_s",
    "time_ckpt_s": "time/checkpoint_stall_s",
    "time_sync_s": "time/metric_sync_s",
    "peak_mem_mb": "memory/peak_mb",
}


# Events the writer's queue holds before add_scalar blocks: SummaryWriter's default, 10, is less than one step's
# scalars, so rank 0 would wait for TensorBoard's writer thread at every step (and every rank for rank 0 in the next
# all-reduce: docs/measurements/overhead.md). Ten thousand hold several hundred steps.
MAX_QUEUE = 10_000


class TensorBoard:
    def __init__(self, log_dir: Path, enabled: bool) -> None:
        self._writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package
        except ImportError as exc:
            log.warning("TensorBoard logging is off: %s (pip install tensorboard, or monitor.tensorboard: false)", exc)
            return
        self._writer = SummaryWriter(log_dir=str(log_dir), max_queue=MAX_QUEUE)

    def write(self, record: dict) -> None:
        if self._writer is None:
            return
        step = record["step"]
        for key, tag in TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)):
                self._writer.add_scalar(tag, value, step, walltime=record.get("time"))
        for dim, seconds in (record.get("comm_by_dim") or {}).items():
            self._writer.add_scalar(f"time/exposed_comm_{dim}_s", seconds, step, walltime=record.get("time"))
        for s in record.get("stragglers") or ():
            self._writer.add_scalar(f"stragglers/rank_{s['rank']}_ratio", s["ratio"], step)

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()
