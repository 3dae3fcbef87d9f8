"""What a node-hour or a GPU-hour costs, so that the run's reports put a price on its node- and GPU-hours."""

from __future__ import annotations

import re
from dataclasses import dataclass

from runconfig.schema.fields import Problems, Range, Section, doc

CURRENCY_RE = re.compile(r"[A-Za-z$€£¥][A-Za-z0-9$€£¥._-]{0,15}")


@dataclass(frozen=True, kw_only=True)
class CostConfig(Section):
    node_hour: float = doc(
        "Price of one node-hour (an allocation's whole nodes, however many GPUs each has); 0 = no price. "
        "`hpc report`, `hpc runs`, `hpc compare` and the tracker show the run's cost and its cost per million "
        "tokens (the recipe's units) from it.",
        0.0,
        bounds=Range(ge=0),
    )
    gpu_hour: float = doc(
        "Price of one GPU-hour (the GPUs Slurm allocated, gres/gpu; locally the ranks on GPUs); 0 = no price. "
        "Set this or cost.node_hour, not both.",
        0.0,
        bounds=Range(ge=0),
    )
    currency: str = doc(
        "What the prices are in, as the reports print it (USD, EUR, credits, ...).", "USD", nonempty="names a unit"
    )

    def relations(self) -> Problems:
        out: Problems = []
        if self.node_hour > 0 and self.gpu_hour > 0:
            out.append(("gpu_hour", "is set beside cost.node_hour: price the run by one of them (the other 0)"))
        if not CURRENCY_RE.fullmatch(self.currency):
            out.append(("currency", f"must be letters, digits or $ € £ ¥ . _ - (at most 16), got {self.currency!r}"))
        return out
