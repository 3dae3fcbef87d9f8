"""One optimizer step (``train_step``) over micro-batches (``forward_backward_step``): the torchtitan split."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from trainer.errors import UserError
from trainer.loop.boundary import agreement_values
from trainer.loop.optim import clip_grad_norm
from trainer.loop.parts import Parts, autocast
from trainer.parallel.cp import batch_loss
from trainer.parallel.tp import plain_loss


@dataclass
class StepResult:
    lr: float
    grad_norm: torch.Tensor
    loss: torch.Tensor  # this rank's loss of the step (mean over its micro-batches), not yet shared


def check_loss(loss: Any, *, recipe: str, rank: int, step: int) -> None:
    """The loss must be a floating-point scalar tensor (finiteness is checked across ranks at the boundary)."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        what = f"a tensor of shape {list(loss.shape)} ({loss.dtype})" if isinstance(loss, torch.Tensor) else repr(loss)
        raise UserError(
            f"rank {rank}: recipe {recipe!r}: the loss at step {step} is {what[:200]}; Recipe.loss must return a "
            "floating-point scalar tensor (the mean loss of the batch).",
            collective=False,
        )


def forward_backward_step(
    parts: Parts, batch: Any, *, step: int, synchronizing: bool, loss_so_far: torch.Tensor
) -> torch.Tensor:
    """Forward and backward of one micro-batch; gradients are reduced over ranks when ``synchronizing`` (the last
    micro-batch of the step), accumulated locally otherwise. Returns the micro-batch's share of the step loss.
    With the agreement carried in the gradient reduction (``p.wrapped.carrier``) the synchronizing backward also
    carries this rank's agreement values: ``loss_so_far`` (the earlier micro-batches' shares) plus this one's is the
    step's loss."""
    mon = parts.mon
    with mon.clock.backward(synchronizing=synchronizing and parts.env.world_size > 1), parts.wrapped.loss_context():
        mon.injector.in_compute(step)
        if parts.wrapped.pipe is not None:  # forward and backward of its pipeline micro-batches, loss scaled there
            with (
                contextlib.nullcontext() if synchronizing else parts.wrapped.no_sync(),
                autocast(parts.cfg, parts.distributed.device),
            ):
                return parts.wrapped.pipe.step(batch)
        with (
            contextlib.nullcontext() if synchronizing else parts.wrapped.no_sync(),
            batch_loss(parts.wrapped.cp, parts.recipe.loss, batch) as loss_of,
        ):
            with autocast(parts.cfg, parts.distributed.device):
                loss = plain_loss(loss_of(parts.wrapped.module))
            check_loss(loss, recipe=parts.cfg.recipe, rank=parts.env.rank, step=step)
            if mon.injector.faults:  # tests: a bad batch (HPC_INJECT spike), by its place in the data order
                loss = loss * mon.injector.loss_factor(
                    parts.state.data_position // parts.cfg.train.global_batch_size + 1
                )
            loss = loss / parts.accum
            carrier = parts.wrapped.carrier if synchronizing else None
            if carrier is None:
                loss.backward()
            else:
                carrier.backward(loss, agreement_values(parts, loss_so_far + loss.detach()))
    return loss.detach()


def train_step(parts: Parts, step: int) -> StepResult:
    """Optimizer step ``step`` (1-based): learning rate, micro-batches, clipping, update."""
    t, opt, clock, watch = parts.cfg.train, parts.optimizer, parts.mon.clock, parts.mon.watchdog
    lr = parts.lr_schedule(step - 1)
    for group in opt.param_groups:
        group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr
    loss = torch.zeros((), device=parts.distributed.device)
    for micro in range(parts.accum):
        watch.enter("data", step)
        with clock.part("data"):
            batch = parts.loader.next()
        watch.enter("forward/backward", step)
        loss += forward_backward_step(parts, batch, step=step, synchronizing=micro == parts.accum - 1, loss_so_far=loss)
    watch.enter("optimizer", step)
    with clock.part("optim"):
        pipe = parts.wrapped.pipe
        if pipe is not None:
            pipe.sync_tied()
        grad_norm = clip_grad_norm(
            parts.params,
            t.grad_clip if t.grad_clip > 0 else float("inf"),
            across=pipe.group if pipe else None,
            counted=parts.counted if pipe else None,
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
    return StepResult(lr=lr, grad_norm=grad_norm, loss=loss)
