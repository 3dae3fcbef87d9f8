"""The decision at a step boundary, the same on every rank. The ranks agree on a step's loss, any rank's stop request
and rank 0's time-based checkpoint trigger; eval and step-count checkpoints follow the step number.

Under DDP over gloo the agreement rides in the step's own gradient reduction (``comm.carry_agreement``, the default;
trainer/parallel/carrier.py): the step's backward carries each rank's three numbers, and its boundary reads their
mean. No collective of its own, nothing deferred: a stop request or time trigger raised before the step's last
backward is acted on at that step's boundary, one raised later at the next one, every rank at the same one.

Elsewhere one small all-reduce of its own shares them. It is deferred (``comm.defer_agreement``, the default):
step t's all-reduce is issued at t's boundary and runs while step t+1 computes; boundary t+1 reads it. So a stop
request or a time trigger raised during step t is acted on at boundary t+1 (every rank at the same one), and step
t's loss is known at boundary t+1 (its record waits for it). A boundary that will save (a step-count or time
checkpoint, an agreed stop) or ends training agrees on its own step synchronously: a checkpoint never holds the
state after a non-finite loss, and the record before a checkpoint is complete. A non-finite loss ends the run,
naming the ranks, before anything after it is saved (carried or not).

A deferred step's gradient norm (this rank's) is read with its agreement. With NCCL both come back to the host
behind an event (``_HostCopy``): boundary t+1 waits for that copy alone, not for step t+1's work queued since
(reading a device tensor would drain the device's queue at every boundary). Over gloo waiting is the only way:
the work completes on gloo's thread."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rundir.checkpoints import read_latest
from trainer.errors import UserError
from trainer.loop.parts import Parts


@dataclass(frozen=True)
class Decision:
    loss: float | None  # the step's loss, mean over ranks; None while its agreement is in flight (deferred)
    stop: bool  # a stop signal reached some rank: checkpoint and leave
    checkpoint: bool
    eval: bool
    last: bool  # the final step of training
    earlier: Earlier | None = None  # the previous step's figures, read at this boundary (deferred); else None
    rung: bool = False  # a rung step of prune.*: checkpointed, evaluated when the metric is an eval one, judged
    memory: bool = False  # a checkpoint in node memory is due (checkpoint.memory_every_steps): its loss is agreed


@dataclass(frozen=True)
class Earlier:
    """A deferred step's figures for its record, known one boundary later."""

    loss: float  # mean over ranks
    grad_norm: float  # this rank's gradient norm of that step


@dataclass(frozen=True)
class _Agreed:
    loss: float  # mean over ranks
    stop: bool
    due_by_time: bool
    grad_norm: float | None = None  # deferred agreements only


@dataclass
class _InFlight:
    """A deferred agreement: its step, the all-reduce's work and tensor, this rank's loss and gradient norm of that
    step (device tensors, held until read), and on NCCL the event after which ``host`` holds them all."""

    step: int
    work: dist.Work
    shared: torch.Tensor
    local_loss: torch.Tensor
    grad_norm: torch.Tensor
    copied: torch.cuda.Event | None = None


class _HostCopy:
    """The side stream and the pinned buffer that bring a deferred agreement to the host behind an event (NCCL)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self.host = torch.empty(4, dtype=torch.float64, pin_memory=True)  # loss sum, stop, due by time; norm

    def issue(self, work: dist.Work, shared: torch.Tensor, grad_norm: torch.Tensor) -> torch.cuda.Event:
        """Queue the copies after ``work`` and the step's queued work on the side stream (the host does not wait
        here). The buffer is free: the previous agreement was read (its event waited for) before this one was issued;
        the device tensors stay referenced (``_InFlight``) until then, so no other work reuses their memory."""
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # the step's norm is computed
        with torch.cuda.stream(self.stream):
            work.wait()  # NCCL: the current stream (this side stream) waits for the all-reduce; the host does not
            self.host[:3].copy_(shared, non_blocking=True)
            self.host[3:].copy_(grad_norm.detach().reshape(1).to(torch.float64), non_blocking=True)
            return self.stream.record_event()


class Boundary:
    """Collective: every rank's ``decide`` returns the same decision (or raises the same error)."""

    def __init__(self, parts: Parts) -> None:
        self.p = parts
        self.carrier = parts.wrapped.carrier
        self.defer = parts.cfg.comm.defer_agreement and self.carrier is None
        self._pending: _InFlight | None = None
        nccl = parts.distributed.device.type == "cuda" and parts.distributed.backend == "nccl"
        self._copy = _HostCopy(parts.distributed.device) if self.defer and nccl else None
        # comm.sync rounds: a stop or a checkpoint waits for the round's end, where every replica holds the same
        # parameters (held here until then)
        self.outer = parts.wrapped.outer
        self._held_stop = self._held_checkpoint = False

    def decide(self, step: int, local_loss: torch.Tensor, grad_norm: torch.Tensor) -> Decision:
        """``local_loss``: this rank's loss of the step; ``grad_norm``: its gradient norm, read for the record
        with a deferred agreement (a synchronous one's record reads it itself)."""
        p, t = self.p, self.p.cfg.train
        last = step == t.steps
        earlier = self._collect()
        prune = p.cfg.prune
        rung = prune.metric is not None and step in prune.at_steps and not last
        # a rung's checkpoint is the one a pruned element keeps (its loss is agreed now: the record is complete)
        checkpoint = p.checkpoints.due_by_steps(step, last) or rung
        memory = p.checkpoints.memory_due(step)  # saved only after a finite loss: agreed now, like a checkpoint's
        if self.outer is not None and self.outer.at_round_end(step, last):
            checkpoint = checkpoint or self._held_stop or self._held_checkpoint  # held for here: agreed now
        stop = loss = None
        if earlier is not None:
            checkpoint = checkpoint or earlier.stop or earlier.due_by_time
            stop = earlier.stop
        if self.carrier is not None:  # agreed in the step's own gradient reduction
            loss_mean, stop_mean, due_mean = self.carrier.read()
            now = self._read(step, loss_mean, stop_mean, due_mean, local_loss)
            loss, stop = now.loss, now.stop
            checkpoint = checkpoint or now.stop or now.due_by_time
        elif not self.defer or checkpoint or memory or last:
            now = self._agreement(step, local_loss, grad_norm, wait=True)
            assert now is not None
            loss, stop = now.loss, bool(stop) or now.stop
            checkpoint = checkpoint or now.stop or now.due_by_time
        else:
            self._agreement(step, local_loss, grad_norm, wait=False)
        stop, checkpoint, memory, rung = self._at_round_end(step, last, bool(stop), checkpoint, memory, rung)
        return Decision(
            loss=loss,
            stop=bool(stop) and not last,
            checkpoint=checkpoint,
            eval=p.recipe.eval_data is not None
            and (bool(t.eval_every) and (step % t.eval_every == 0 or last) or rung and prune.metric.startswith("eval")),
            last=last,
            earlier=_earlier(earlier),
            rung=rung,
            memory=memory,
        )

    def _at_round_end(
        self, step: int, last: bool, stop: bool, checkpoint: bool, memory: bool, rung: bool
    ) -> tuple[bool, bool, bool, bool]:
        """(stop, checkpoint, memory, rung) as comm.sync rounds allow them: held from a step inside a round to its
        end. Without rounds, unchanged."""
        if self.outer is None:
            return stop, checkpoint, memory, rung
        if not self.outer.at_round_end(step, last):
            self._held_stop |= stop
            self._held_checkpoint |= checkpoint
            return False, False, False, False
        stop, checkpoint = stop or self._held_stop, checkpoint or self._held_checkpoint or self._held_stop
        self._held_stop = self._held_checkpoint = False
        return stop, checkpoint, memory, rung

    def settle(self) -> Earlier | None:
        """Collective: wait for the agreement in flight, if any (the launch ends early); its step's figures."""
        return _earlier(self._collect())

    def _agreement(self, step: int, local_loss: torch.Tensor, grad_norm: torch.Tensor, *, wait: bool) -> _Agreed | None:
        """Issue step ``step``'s agreement; ``wait``: read it now (the record reads the norm itself), else keep it
        in flight with the norm, for the next boundary."""
        p = self.p
        with p.mon.clock.part("sync"):
            shared = agreement_values(p, local_loss, torch.float64)
            work = dist.all_reduce(shared, async_op=True)
            if not wait:
                copied = self._copy.issue(work, shared, grad_norm) if self._copy is not None else None
                self._pending = _InFlight(step, work, shared, local_loss, grad_norm, copied)
                return None
            work.wait()
            loss_sum, stop, due_by_time = shared.tolist()
            return self._read(step, loss_sum / p.env.world_size, stop, due_by_time, local_loss)

    def _collect(self) -> _Agreed | None:
        """The deferred agreement of the previous step (waited for: it has had a whole step to finish)."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        with self.p.mon.clock.part("sync"):
            if pending.copied is not None:
                pending.copied.synchronize()  # the copies alone: the training stream's queue keeps its work
                *values, grad_norm = self._copy.host.tolist()
            else:
                pending.work.wait()
                values, grad_norm = pending.shared.tolist(), float(pending.grad_norm)
        loss_sum, stop, due_by_time = values
        return self._read(
            pending.step, loss_sum / self.p.env.world_size, stop, due_by_time, pending.local_loss, grad_norm
        )

    def _read(
        self,
        step: int,
        loss: float,
        stop: float,
        due_by_time: float,
        local_loss: torch.Tensor,
        grad_norm: float | None = None,
    ) -> _Agreed:
        """``loss``: the mean over ranks; ``stop``, ``due_by_time``: the ranks' flags summed or averaged (> 0: some
        rank's is set)."""
        if not math.isfinite(loss):
            _non_finite(self.p, step, local_loss)
        return _Agreed(loss=loss, stop=stop > 0, due_by_time=due_by_time > 0, grad_norm=grad_norm)


def agreement_values(parts: Parts, local_loss: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's share of a step's agreement: its loss of the step, its stop request, rank 0's time trigger."""
    values = torch.zeros(3, dtype=dtype, device=local_loss.device)
    values[0] = local_loss
    values[1] = float(parts.stop.requested)
    values[2] = float(parts.env.rank == 0 and parts.checkpoints.due_by_time())
    return values


def _earlier(agreed: _Agreed | None) -> Earlier | None:
    if agreed is None:
        return None
    assert agreed.grad_norm is not None  # a deferred agreement's
    return Earlier(loss=agreed.loss, grad_norm=agreed.grad_norm)


def _non_finite(parts: Parts, step: int, local_loss: torch.Tensor) -> None:
    """Name the ranks whose loss is not finite, then stop every rank (no checkpoint of this step is written)."""
    losses = [None] * parts.env.world_size
    dist.all_gather_object(losses, float(local_loss))
    bad = [r for r, v in enumerate(losses) if not math.isfinite(v)]
    latest = read_latest(parts.checkpoints.root)  # what a resume would load; this step's state is never saved
    raise UserError(
        f"rank {bad[0]}: recipe {parts.cfg.recipe!r}: the loss at step {step} is not finite "
        f"({', '.join(f'rank {r}: {losses[r]}' for r in bad)}). Training stopped; "
        + (
            f"the newest committed checkpoint, {latest} in {parts.checkpoints.root}, is intact."
            if latest
            else "no checkpoint had been committed, nothing was saved."
        ),
        collective=True,
        rank=bad[0],
    )
