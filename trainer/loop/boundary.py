"""The decision at a step boundary, the same on every rank. One small all-reduce shares a step's loss, any rank's
stop request and rank 0's time-based checkpoint trigger; eval and step-count checkpoints follow the step number.

The agreement is deferred (``comm.defer_agreement``, the default): step t's all-reduce is issued at t's boundary and
runs while step t+1 computes; boundary t+1 reads it. So a stop request or a time trigger raised during step t is
acted on at boundary t+1 (every rank at the same one), and step t's loss is known at boundary t+1 (its record waits
for it). A boundary that will save (a step-count or time checkpoint, an agreed stop) or ends training agrees on its
own step synchronously: a checkpoint never holds the state after a non-finite loss, and the record before a
checkpoint is complete. A non-finite loss ends the run, naming the ranks, before anything after it is saved."""

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
    loss: float | None  # the step's loss, mean over ranks; None while its agreement is in flight (deferred)
    stop: bool  # a stop signal reached some rank: checkpoint and leave
    checkpoint: bool
    eval: bool
    last: bool  # the final step of training
    earlier_loss: float | None = None  # the previous step's loss, agreed at this boundary (deferred); else None


@dataclass(frozen=True)
class _Agreed:
    loss: float  # mean over ranks
    stop: bool
    due_by_time: bool


class Boundary:
    """Collective: every rank's ``decide`` returns the same decision (or raises the same error)."""

    def __init__(self, p: Parts) -> None:
        self.p = p
        self.defer = p.cfg.comm.defer_agreement
        # the agreement in flight: (step, work, shared tensor, this rank's loss of that step)
        self._pending: tuple[int, dist.Work, torch.Tensor, torch.Tensor] | None = None

    def decide(self, step: int, local_loss: torch.Tensor) -> Decision:
        p, t = self.p, self.p.cfg.train
        last = step == t.steps
        earlier = self._collect()
        checkpoint = p.checkpoints.due_by_steps(step, last)
        stop = loss = None
        if earlier is not None:
            checkpoint = checkpoint or earlier.stop or earlier.due_by_time
            stop = earlier.stop
        if not self.defer or checkpoint or last:
            now = self._agreement(step, local_loss, wait=True)
            assert now is not None
            loss, stop = now.loss, bool(stop) or now.stop
            checkpoint = checkpoint or now.stop or now.due_by_time
        else:
            self._agreement(step, local_loss, wait=False)
        return Decision(
            loss=loss,
            stop=bool(stop) and not last,
            checkpoint=checkpoint,
            eval=p.recipe.eval_data is not None and bool(t.eval_every) and (step % t.eval_every == 0 or last),
            last=last,
            earlier_loss=None if earlier is None else earlier.loss,
        )

    def settle(self) -> float | None:
        """Collective: wait for the agreement in flight, if any (the launch ends early); its step's loss."""
        agreed = self._collect()
        return None if agreed is None else agreed.loss

    def _agreement(self, step: int, local_loss: torch.Tensor, *, wait: bool) -> _Agreed | None:
        p = self.p
        with p.mon.clock.part("sync"):
            shared = torch.zeros(3, dtype=torch.float64, device=p.d.device)
            shared[0] = local_loss
            shared[1] = float(p.stop.requested)
            shared[2] = float(p.env.rank == 0 and p.checkpoints.due_by_time())
            work = dist.all_reduce(shared, async_op=True)
            if not wait:
                self._pending = (step, work, shared, local_loss)
                return None
            work.wait()
            return self._read(step, shared, local_loss)

    def _collect(self) -> _Agreed | None:
        """The deferred agreement of the previous step (waited for: it has had a whole step to finish)."""
        if self._pending is None:
            return None
        step, work, shared, local_loss = self._pending
        self._pending = None
        with self.p.mon.clock.part("sync"):
            work.wait()
        return self._read(step, shared, local_loss)

    def _read(self, step: int, shared: torch.Tensor, local_loss: torch.Tensor) -> _Agreed:
        loss_sum, stop, due_by_time = shared.tolist()
        if not math.isfinite(loss_sum):
            _non_finite(self.p, step, local_loss)
        return _Agreed(loss=loss_sum / self.p.env.world_size, stop=bool(stop), due_by_time=bool(due_by_time))


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
