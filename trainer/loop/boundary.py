"""The decision at a step boundary, the same on every rank: one small all-reduce shares the step's loss, any
rank's stop request and rank 0's time-based checkpoint trigger; eval and step-count checkpoints follow the step
number. A non-finite loss ends the run here, before anything of the step is saved."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runconfig.checkpoints import read_latest
from trainer.errors import UserError
from trainer.loop.parts import Parts


@dataclass(frozen=True)
class Decision:
    loss: float  # the step's loss, mean over ranks
    stop: bool  # a stop signal reached some rank: checkpoint and leave
    checkpoint: bool
    eval: bool
    last: bool  # the final step of training


def decide(p: Parts, step: int, local_loss: torch.Tensor) -> Decision:
    """Collective. Every rank returns the same decision (or raises the same error)."""
    t = p.cfg.train
    with p.mon.clock.part("sync"):
        shared = torch.zeros(3, dtype=torch.float64, device=p.d.device)
        shared[0] = local_loss
        shared[1] = float(p.stop.requested)
        shared[2] = float(p.env.rank == 0 and p.checkpoints.due_by_time())
        dist.all_reduce(shared)
        loss_sum, stop, due_by_time = shared.tolist()
    if not math.isfinite(loss_sum):
        _non_finite(p, step, local_loss)
    last = step == t.steps
    return Decision(
        loss=loss_sum / p.env.world_size,
        stop=bool(stop) and not last,
        checkpoint=bool(stop) or bool(due_by_time) or p.checkpoints.due_by_steps(step, last),
        eval=p.recipe.eval_data is not None and bool(t.eval_every) and (step % t.eval_every == 0 or last),
        last=last,
    )


def _non_finite(p: Parts, step: int, local_loss: torch.Tensor) -> None:
    """Name the ranks whose loss is not finite, then stop every rank (no checkpoint of this step is written)."""
    losses = [None] * p.env.world_size
    dist.all_gather_object(losses, float(local_loss))
    bad = [r for r, v in enumerate(losses) if not math.isfinite(v)]
    latest = read_latest(p.checkpoints.root)  # what a resume would load; this step's state is never saved
    raise UserError(
        f"rank {bad[0]}: recipe {p.cfg.recipe!r}: the loss at step {step} is not finite "
        f"({', '.join(f'rank {r}: {losses[r]}' for r in bad)}). Training stopped; "
        + (
            f"the newest committed checkpoint, {latest} in {p.checkpoints.root}, is intact."
            if latest
            else "no checkpoint had been committed, nothing was saved."
        ),
        collective=True,
        rank=bad[0],
    )
