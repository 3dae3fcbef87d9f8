"""Held-out evaluation: the recipe's loss (and extra metrics) over a fixed, evenly spaced set of eval samples,
split over the ranks, sample-weighted means over all of them."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from trainer.data.loader import fetch, to_device
from trainer.loop.parts import Parts, autocast
from trainer.loop.step import check_loss


def eval_ids(n: int, count: int) -> np.ndarray:
    """``count`` evenly spaced sample indices of a dataset of ``n`` (fewer when n < count)."""
    return np.unique(np.linspace(0, n - 1, count).astype(np.int64))


def evaluate(parts: Parts, step: int) -> dict[str, float]:
    """{"eval_loss": ..., "eval_<metric>": ...}. Collective."""
    data, recipe, cfg = parts.recipe.eval_data, parts.recipe, parts.cfg
    layout = parts.wrapped.layout
    everyone = eval_ids(len(data), cfg.train.eval_sequences)
    # Split over the data-parallel ranks: a tensor-parallel group evaluates the same samples together (and
    # counts them once per member in the sums below, which leaves the means unchanged).
    mine = everyone[layout.dp_rank(parts.env.rank) :: layout.dp]
    mb = cfg.train.micro_batch_size
    pipe = parts.wrapped.pipe
    if pipe is not None:  # whole micro-batches only: the schedule cuts each into its pipeline micro-batches
        mine = mine[: len(mine) // mb * mb]
    # A sharded model's forward is collective (it gathers each block's parameters), so is a pipeline's: every
    # rank runs as many batches as the busiest one, a rank short of samples repeating a batch with weight 0.
    busiest = len(everyone[:: layout.dp]) // mb * mb if pipe is not None else len(everyone[:: layout.dp])
    rounds = -(-busiest // mb) if layout.uses_mesh else -(-len(mine) // mb)
    names: list[str] | None = None
    totals: torch.Tensor | None = None  # [samples, loss sum, metric sums...] in float64
    was_training = parts.model.training
    parts.model.eval()
    try:
        with torch.no_grad():
            for start in range(0, rounds * mb, mb):
                ids = mine[start : start + mb]
                weight = 1.0 if len(ids) else 0.0
                if not len(ids):
                    ids = mine[-mb:] if len(mine) else everyone[: mb if pipe is not None else 1]
                batch = to_device(
                    fetch(
                        data,
                        ids,
                        recipe.collate or default_collate,
                        what=f"recipe {cfg.recipe!r}: eval_data",
                        rank=parts.env.rank,
                    ),
                    parts.distributed.device,
                )
                if pipe is not None:  # the loss on the last stage only; eval_metrics need the whole model
                    with autocast(cfg, parts.distributed.device):
                        loss, metrics = pipe.eval_loss(batch), {}
                    if loss is None:
                        weight, loss = 0.0, torch.zeros(())
                else:
                    with autocast(cfg, parts.distributed.device):
                        loss = recipe.loss(parts.model, batch)
                        metrics = dict(recipe.eval_metrics(parts.model, batch)) if recipe.eval_metrics else {}
                check_loss(loss, recipe=cfg.recipe, rank=parts.env.rank, step=step)
                if names is None:
                    names = sorted(metrics)
                n = len(ids) * weight
                values = [n, float(loss) * n, *(float(metrics[k]) * n for k in names)]
                row = torch.tensor(values, dtype=torch.float64, device=parts.distributed.device)
                totals = row if totals is None else totals + row
    finally:
        parts.model.train(was_training)
    # Every rank must bring the same vector: a rank without eval samples (more ranks than samples) brings zeros.
    width = torch.tensor([0 if totals is None else totals.numel()], device=parts.distributed.device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    if totals is None:
        totals = torch.zeros(int(width), dtype=torch.float64, device=parts.distributed.device)
    dist.all_reduce(totals)
    n = float(totals[0])
    out = {"eval_loss": float(totals[1]) / n}
    names = names or []
    for i, name in enumerate(names):
        out[f"eval_{name}"] = float(totals[2 + i]) / n
    return out
