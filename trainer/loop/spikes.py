"""Loss and gradient-norm spikes (``train.spike_*``). A step's loss is its agreed loss, the mean over ranks, the same
number on every rank. Its gradient norm is the global one that clipping uses, the same on every rank of every
layout. So every rank decides alike without a message. A step whose loss exceeds ``spike_factor`` times the median
of the launch's recent losses is a spike, and so is one whose norm exceeds ``spike_grad_factor`` times the median of
their norms. ``stop`` ends the run with an error. ``rollback`` ends the launch, and the restart resumes from the
newest checkpoint (the spike's step is never checkpointed) and skips the data from that checkpoint through the
spike's batch: RUN_DIR/data_skips.json, applied at every later restore from a checkpoint before the spike."""

from __future__ import annotations

import json
import logging
import statistics
from collections import deque
from collections.abc import Callable

from runconfig.schema import TrainConfig
from rundir import RunDir
from storage.files import write_json_atomic
from trainer.errors import UserError

log = logging.getLogger(__name__)
MIN_SEEN = 8  # losses seen in the launch before a spike can be judged


class LossSpike(Exception):
    """Raised by every rank at a spike with spike_action rollback; ``info``: the spike."""

    def __init__(self, info: dict) -> None:
        super().__init__(info["message"])
        self.info = info


class SpikeWatch:
    def __init__(self, cfg: TrainConfig) -> None:
        self.factor, self.grad_factor, self.action = cfg.spike_factor, cfg.spike_grad_factor, cfg.spike_action
        self.on = bool(self.factor or self.grad_factor)
        self.losses: deque[float] = deque(maxlen=cfg.spike_window)
        self.norms: deque[float] = deque(maxlen=cfg.spike_window)

    def see(
        self, step: int, loss: float, grad_norm: float, data_position: int, newest: Callable[[], str | None]
    ) -> None:
        """The agreed loss and the gradient norm of ``step`` (``data_position``: the data order's position after
        it; ``newest``: the newest committed checkpoint's name, asked at a spike only). Raises at a spike."""
        if not self.on:
            return
        if len(self.losses) >= MIN_SEEN:
            for measure, value, factor, recent in (
                ("loss", loss, self.factor, self.losses),
                ("grad_norm", grad_norm, self.grad_factor, self.norms),
            ):
                median = statistics.median(recent)
                if factor and median > 0 and value > factor * median:
                    self._spike(step, measure, value, median, factor, loss, data_position, newest())
        self.losses.append(loss)
        self.norms.append(grad_norm)

    def _spike(
        self,
        step: int,
        measure: str,
        value: float,
        median: float,
        factor: float,
        loss: float,
        position: int,
        newest: str | None,
    ) -> None:
        key, name = ("spike_factor", "loss") if measure == "loss" else ("spike_grad_factor", "gradient norm")
        what = (
            f"{name} spike at step {step}: {name} {value:.4g} is {value / median:.1f}x the median {median:.4g} of "
            f"the last {len(self.losses)} steps (train.{key}={factor:g})"
        )
        if self.action == "stop":
            kept = f"the newest committed checkpoint, {newest}, is intact" if newest else "nothing was saved"
            raise UserError(f"{what}. Training stopped (train.spike_action: stop); {kept}.", collective=True, rank=0)
        message = (
            f"{what}: the run goes back to {newest or 'its start'} and skips the data through this step's batch "
            "(train.spike_action: rollback)"
        )
        raise LossSpike({"step": step, "loss": loss, "median": median, "skip_to_position": position,
                         "measure": measure, "value": value, "message": message})  # fmt: skip


def skips_path(rundir: RunDir):
    return rundir.data_skips


def record_skip(rundir: RunDir, info: dict) -> None:
    """Rank 0: add the spike's data window to RUN_DIR/data_skips.json (atomically; earlier ones kept)."""
    path = skips_path(rundir)
    try:
        skips = json.loads(path.read_text())["skips"]
    except (OSError, ValueError, KeyError, TypeError):
        skips = []
    skips.append({"spike_step": info["step"], "skip_to_position": info["skip_to_position"]})
    write_json_atomic(path, {"skips": skips})


def apply_skips(rundir: RunDir, step: int, data_position: int) -> tuple[int, list[dict]]:
    """The data position to train from after restoring ``step`` at ``data_position``: past every recorded spike
    window that this checkpoint predates. Returns (position, the skips applied)."""
    try:
        skips = json.loads(skips_path(rundir).read_text())["skips"]
    except (OSError, ValueError, KeyError, TypeError):
        return data_position, []
    applied = [s for s in skips if step < s["spike_step"] and data_position < s["skip_to_position"]]
    for s in applied:
        data_position = max(data_position, int(s["skip_to_position"]))
    return data_position, applied
