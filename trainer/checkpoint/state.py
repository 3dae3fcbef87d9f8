"""Everything that advances with the optimizer steps, as one object the checkpointer saves without knowing its
fields (``state_dict``/``load_state_dict``), and the one formula for per-rank random streams."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class TrainState:
    """The loop's state besides model and optimizer. The data position (samples consumed over all ranks in the
    global order) is the whole data state: a run resumes at any world size from it."""

    step: int = 0
    tokens_seen: int = 0  # units (the recipe's: tokens, images...) seen over all ranks
    data_position: int = 0
    # which global order the position counts in (trainer/data/order.py, OrderSpec): None in checkpoints written
    # before the windowed order existed, which used the full permutation
    data_order: dict | None = None
    last_loss: float | None = None
    last_eval_loss: float | None = None
    last_eval: dict | None = None  # {"step": ..., "eval_loss": ..., "eval_<metric>": ...} of the latest evaluation
    elapsed_s: float = 0.0  # wall time spent in training over all runs of this run directory
    # comm.allreduce=auto: the measured plan (rundir/allreduce_plan.py), reused on resume so the gradients are
    # reduced in the same order as before the stop
    allreduce_plan: dict | None = None

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            if f.name in state:  # a checkpoint written before a field existed keeps its default
                setattr(self, f.name, state[f.name])


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """Seed of rank ``rank``'s random streams (dropout, augmentation) from ``step`` on: distinct across ranks,
    reproducible for a fixed seed. Step 0 is a fresh run; a resume at another world size reseeds at its step."""
    return seed * 1_000_003 + 7919 * step + 1 + rank
