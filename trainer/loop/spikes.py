"""Loss spikes (``train.spike_*``): a step whose agreed loss (the mean over ranks, the same number on every rank, so
every rank decides alike without a message) exceeds ``spike_factor`` times the median of the launch's recent
losses. ``stop`` ends the run with an error; ``rollback`` ends the launch, and the restart resumes from the newest
checkpoint (the spike's step is never checkpointed) and skips the data from that checkpoint through the spike's
batch: RUN_DIR/data_skips.json, applied at every later restore from a checkpoint before the spike."""

from __future__ import annotations

import json
import logging
import statistics
from collections import deque
from collections.abc import Callable

from runconfig import RunDir
from runconfig.contract import write_json_atomic
from runconfig.schema import TrainConfig
from trainer.errors import UserError

log = logging.getLogger(__name__)
MIN_SEEN = 8  # losses seen in the launch before a spike can be judged
SKIPS_NAME = "data_skips.json"


class LossSpike(Exception):
    """Raised by every rank at a spike with spike_action rollback; ``info``: the spike."""

    def __init__(self, info: dict) -> None:
        super().__init__(info["message"])
        self.info = info


class SpikeWatch:
    def __init__(self, cfg: TrainConfig) -> None:
        self.factor, self.action = cfg.spike_factor, cfg.spike_action
        self.recent: deque[float] = deque(maxlen=cfg.spike_window)

    def see(self, step: int, loss: float, data_position: int, newest: Callable[[], str | None]) -> None:
        """The agreed loss of ``step`` (``data_position``: the data order's position after it; ``newest``: the
        newest committed checkpoint's name, asked at a spike only). Raises at a spike."""
        if not self.factor:
            return
        if len(self.recent) >= MIN_SEEN:
            median = statistics.median(self.recent)
            if median > 0 and loss > self.factor * median:
                self._spike(step, loss, median, data_position, newest())
        self.recent.append(loss)

    def _spike(self, step: int, loss: float, median: float, position: int, newest: str | None) -> None:
        what = (
            f"loss spike at step {step}: loss {loss:.4g} is {loss / median:.1f}x the median {median:.4g} of the last "
            f"{len(self.recent)} steps (train.spike_factor={self.factor:g})"
        )
        if self.action == "stop":
            kept = f"the newest committed checkpoint, {newest}, is intact" if newest else "nothing was saved"
            raise UserError(f"{what}. Training stopped (train.spike_action: stop); {kept}.", collective=True, rank=0)
        message = (
            f"{what}: the run goes back to {newest or 'its start'} and skips the data through this step's batch "
            "(train.spike_action: rollback)"
        )
        raise LossSpike({"step": step, "loss": loss, "median": median, "skip_to_position": position,
                         "message": message})  # fmt: skip


def skips_path(rundir: RunDir):
    return rundir.root / SKIPS_NAME


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
