"""Start-up, the restore: the newest valid checkpoint (or step 0), a rolled-back spike's data skipped, and the
run's sample order fixed."""

from __future__ import annotations

import logging

from rundir import RunDir
from trainer.data.order import bucketing, chosen_order
from trainer.loop.parts import Parts
from trainer.loop.spikes import apply_skips

log = logging.getLogger("trainer")


def restore_or_start(parts: Parts, rundir: RunDir) -> bool:
    """Resume from the newest valid checkpoint when there is one (and checkpoint.resume); True if resumed."""
    resumed = bool(parts.cfg.checkpoint.resume) and parts.checkpoints.restore(parts.state)
    # a loss spike rolled back to before it: its data is skipped (trainer/loop/spikes.py), whatever train.spike_*
    # says now
    position, applied = apply_skips(rundir, parts.state.step, parts.state.data_position)
    if applied:
        log.info("restored step %d: skipping the data of a loss spike (positions %d..%d of the data order)",
                 parts.state.step, parts.state.data_position, position)  # fmt: skip
        parts.state.data_position = position
    data = parts.cfg.data
    spec = chosen_order(data.order, data.shuffle_window, parts.state.data_order, resumed, *bucketing(parts.cfg))
    parts.state.data_order = spec.as_dict()
    parts.loader.use_order(spec)
    return resumed
