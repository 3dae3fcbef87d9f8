"""Early stopping of a sweep's poor elements (ASHA): at fixed steps each element reports a metric to the sweep's
rung file and stops, as "pruned", when it is worse than the best 1/eta of what the elements reported there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runconfig.schema.fields import Problems, Range, Section, doc


@dataclass(frozen=True, kw_only=True)
class PruneConfig(Section):
    metric: str | None = doc(
        "The metrics.jsonl key judged at each rung (e.g. eval_loss: an evaluation runs at every rung step); unset: "
        "no pruning. Set by `python -m hpc sweep` from the sweep file's prune section.",
        None,
    )
    mode: Literal["min", "max"] = doc("Whether a lower (min) or a higher (max) value of prune.metric is better.", "min")
    at_steps: list[int] = doc(
        "The rung steps, ascending: at each, the element reports prune.metric and continues only if it is among "
        "the best 1/prune.eta of the values reported at that step so far (itself included; an element that is "
        "first at a rung always continues).",
        factory=list,
    )
    eta: float = doc("ASHA's reduction factor: the share 1/eta of each rung continues.", 3.0, bounds=Range(gt=1))
    rungs: str | None = doc(
        "The file the sweep's elements report to (JSON lines, appended under a lock); unset: RUN_DIR/../rungs.jsonl.",
        None,
    )

    def relations(self) -> Problems:
        if self.metric is None:
            return [("at_steps", "is set without prune.metric")] if self.at_steps else []
        if not self.metric.strip():
            return [("metric", "must name a metrics.jsonl key, e.g. eval_loss")]
        if not self.at_steps:
            return [("at_steps", "needs at least one step when prune.metric is set")]
        if any(s < 1 for s in self.at_steps) or list(self.at_steps) != sorted(set(self.at_steps)):
            return [("at_steps", f"must be ascending steps >= 1 without repeats, got {list(self.at_steps)}")]
        return []
