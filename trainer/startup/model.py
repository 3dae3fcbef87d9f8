"""Start-up, the model: placed on the device and split for the layout (meta init: each rank fills only its part),
then settled by a throw-away pass (DDP's buckets rebuilt, the first loss checked); its FLOPs per sample counted."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch.utils.data import default_collate

from runconfig import RunConfig
from trainer.data.loader import BatchLoader, fetch, to_device
from trainer.env import RuntimeEnv, agree
from trainer.errors import UserError, first_line
from trainer.loop.parts import autocast
from trainer.parallel.autotune import bucket_sizes
from trainer.parallel.cp import batch_loss
from trainer.parallel.distributed import Distributed
from trainer.parallel.grad_buckets import ddp_bucket_bytes
from trainer.parallel.materialise import buffers_to, owners
from trainer.parallel.materialise import materialise as fill
from trainer.parallel.tp import plain_loss
from trainer.parallel.wrap import Wrapped, wrap
from trainer.recipes.api import Recipe

log = logging.getLogger("trainer")


def place_model(
    cfg: RunConfig, env: RuntimeEnv, distributed: Distributed, recipe: Recipe, comm: MPI.Comm, *, flops: bool = False
) -> tuple[Wrapped, dict[str, list], float | None]:
    """The recipe's model on the device, split for the layout (``wrap``); with parallel.meta_init each rank
    allocates and fills only its part after the split. Also the whole model's {name: [*shape, dtype]}, and with
    ``flops`` (MFU is reported) the training FLOPs of a sample: the recipe's, else counted on fake tensors of the
    whole model before it is split (a pipeline stage, a shard or a tensor-parallel piece cannot run alone)."""
    per_sample = count_flops_per_sample(cfg, recipe, distributed) if flops else None
    materialise, init_error = None, []
    if cfg.parallel.meta_init:  # parameters on meta: split first, then allocate and fill this rank's part only
        model = recipe.model
        buffers_to(model, distributed.device)
        plan = owners(model)
        seed, spec = cfg.train.seed, cfg.recipe

        def materialise(part: torch.nn.Module) -> None:
            error = fill(part, plan, recipe.init_weights, seed=seed, device=distributed.device, spec=spec,
                         host=cfg.parallel.offload)  # fmt: skip
            init_error.append(error)
    else:
        model = recipe.model.to(distributed.device)
    shapes = {n: [*q.shape, str(q.dtype)] for n, q in model.named_parameters()}  # the whole model's
    wrapped = wrap(cfg, env, distributed, model, recipe, materialise=materialise)
    if cfg.parallel.meta_init:
        agree(comm, init_error[0] if init_error else None)
    return wrapped, shapes, per_sample


def settle(
    cfg: RunConfig,
    env: RuntimeEnv,
    wrapped: Wrapped,
    recipe: Recipe,
    loader: BatchLoader,
    comm: MPI.Comm,
) -> None:
    """One throw-away forward/backward on this rank's first micro-batch, so DDP rebuilds its gradient buckets (in
    gradient-ready order) before the first real step in every run: without it the first step after a restart
    reduces in the initial bucket layout while the uninterrupted run used the rebuilt one, and resume would not
    be bit-exact. It doubles as the check that the loss is a finite scalar (under pipeline parallelism: on the
    last stage, through the schedule). Where DDP runs (or, for auto, may run) the trainer's hook, a second pass
    rebuilds the buckets, whose sizes are then noted. Gradients are discarded."""
    pipe, tp = wrapped.pipe, wrapped.layout.tp
    # under context parallelism the pass runs as a step does: each rank its part of the sequence, in the ring
    with contextlib.ExitStack() as held:
        error, loss = None, None
        try:
            batch = loader.batch_at(0, 0)
            with autocast(cfg, loader.device):
                if pipe is None:
                    loss_of = held.enter_context(batch_loss(wrapped.cp, recipe.loss, batch))
                    loss = plain_loss(loss_of(wrapped.module))
                else:
                    try:
                        loss = pipe.step(batch)
                    except UserError as exc:  # the recipe's Pipeline.loss, checked inside the schedule
                        raise UserError(f"rank {env.rank}: recipe {cfg.recipe!r}: {exc}") from None
            if pipe is None or pipe.last:
                check_first_loss(cfg.recipe, env.rank, loss)
        except UserError as exc:
            error = str(exc)
        except (RuntimeError, ValueError) as exc:
            if tp == 1:
                raise
            error = (
                f"rank {env.rank}: recipe {cfg.recipe!r}: the first forward under parallel.tp={tp} raised "
                f"{first_line(exc).rstrip('.')}. With tensor parallelism each rank holds 1/{tp} of the split layers, "
                "so the model's forward must take its sizes from the tensors (e.g. x.view(b, t, -1, head_dim), not "
                "n_heads), and the recipe's tp_plan must match how the layers connect."
                + (
                    " Under parallel.loss_parallel the loss takes the output layer's logits split by class: torch "
                    "computes F.cross_entropy on them (class-index targets, no label_smoothing) and little else."
                    if cfg.parallel.loss_parallel
                    else ""
                )
            )
        if pipe is not None:
            if error is not None:  # the other stages may be inside the schedule, waiting for this one: end the job
                raise UserError(error)
            agree(comm, None)
        else:
            agree(comm, error)  # before backward: its all-reduce needs every rank
            throwaway_backward(wrapped, loss)
            if wrapped.dispatch is not None:
                # DDP rebuilds its buckets at the next forward (in gradient-ready order, at the configured caps; the
                # first backward ran its initial layout, whose first bucket is 1 MB whatever comm.bucket_mb says). One
                # more pass, so that the sizes noted below are the ones training reduces: the sizes auto's plan is
                # measured for and the overlapped reduction is checked on.
                with autocast(cfg, loader.device):
                    loss = recipe.loss(wrapped.module, batch)
                throwaway_backward(wrapped, loss)
    (wrapped.carrier or wrapped.model).zero_grad(set_to_none=True)  # the carrier holds the model
    if wrapped.dispatch is not None:
        wrapped.dispatch.sizes = bucket_sizes(ddp_bucket_bytes(wrapped.module))


def throwaway_backward(wrapped: Wrapped, loss: torch.Tensor) -> None:
    """Backward of a throw-away pass as training runs it: with the carried agreement's term where there is one
    (DDP expects a gradient for every parameter it holds, and rebuilds its buckets in the order they came)."""
    if wrapped.carrier is None:
        loss.backward()
    else:
        wrapped.carrier.backward(loss)


def check_first_loss(spec: str, rank: int, loss: Any) -> None:
    """The loss of the first batch must be a finite floating-point scalar tensor."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)[:200]
        raise UserError(
            f"rank {rank}: recipe {spec!r}: the loss of the first batch is {what}; Recipe.loss must return a "
            "floating-point scalar tensor (the mean loss of the batch)."
        )
    if not torch.isfinite(loss.detach()):
        raise UserError(
            f"rank {rank}: recipe {spec!r}: the loss of the first batch is {float(loss)} before any training step "
            "(check the data and the loss function)."
        )


def count_flops_per_sample(cfg: RunConfig, recipe: Recipe, distributed: Distributed) -> float | None:
    """The recipe's FLOPs per sample, else counted with FlopCounterMode on one forward/backward of one micro-batch
    of the bare model over fake tensors: shapes only, so no memory is taken and no random number drawn, whatever
    the layout will split and wherever the parameters are (the meta device included). None, with a warning, where
    the recipe's loss cannot run on fake tensors (e.g. it reads a value: ``.item()``)."""
    if recipe.flops_per_sample:
        return float(recipe.flops_per_sample)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import FlopCounterMode

    ids = np.arange(min(cfg.train.micro_batch_size, len(recipe.train_data)))
    batch = to_device(
        fetch(recipe.train_data, ids, recipe.collate or default_collate, what="train_data", rank=0), distributed.device
    )
    model, device, mode = recipe.model, distributed.device, FakeTensorMode()
    try:
        with mode:
            fake = {
                name: torch.empty(t.shape, dtype=t.dtype, device=device, requires_grad=t.requires_grad)
                for name, t in [*model.named_parameters(), *model.named_buffers()]
            }
        fake_batch = tree_map(lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, batch)
        with mode, _reparametrize_module(model, fake), FlopCounterMode(display=False) as counter:
            recipe.loss(model, fake_batch).backward()  # gradients of the fake parameters only
    except Exception as exc:  # noqa: BLE001 (any failure of the recipe's code on fake tensors costs MFU only)
        log.warning("MFU not reported: recipe %r's loss could not be counted on fake tensors (%s); give the Recipe "
                    "flops_per_sample", cfg.recipe, first_line(exc))  # fmt: skip
        return None
    return counter.get_total_flops() / len(ids)
