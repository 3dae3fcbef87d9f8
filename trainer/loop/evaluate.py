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
from trainer.parallel.tp import plain_loss


def eval_ids(n: int, count: int) -> np.ndarray:
    """``count`` evenly spaced sample indices of a dataset of ``n`` (fewer when n < count)."""
    return np.unique(np.linspace(0, n - 1, count).astype(np.int64))


def evaluate(parts: Parts, step: int) -> dict[str, float]:
    """{"eval_loss": ..., "eval_<metric>": ...}. Collective."""
    cfg = parts.cfg
    everyone, mine, rounds = _share(parts)
    mb = cfg.train.micro_batch_size
    pipe = parts.wrapped.pipe
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
                loss, metrics = _forward(parts, ids)
                if loss is None:
                    weight, loss = 0.0, torch.zeros(())
                check_loss(loss, recipe=cfg.recipe, rank=parts.env.rank, step=step)
                if names is None:
                    names = sorted(metrics)
                n = len(ids) * weight
                values = [n, float(loss) * n, *(float(metrics[k]) * n for k in names)]
                row = torch.tensor(values, dtype=torch.float64, device=parts.distributed.device)
                totals = row if totals is None else totals + row
    finally:
        parts.model.train(was_training)
    return _means(parts, totals, names or [])


def _share(parts: Parts) -> tuple[np.ndarray, np.ndarray, int]:
    """(every eval sample, this rank's, the number of batches this rank runs)."""
    cfg, layout, pipe = parts.cfg, parts.wrapped.layout, parts.wrapped.pipe
    everyone = eval_ids(len(parts.recipe.eval_data), cfg.train.eval_sequences)
    # Split over the data-parallel ranks: a tensor-parallel group evaluates the same samples together (and
    # counts them once per member in the sums below, which leaves the means unchanged).
    mine = everyone[layout.dp_rank(parts.env.rank) :: layout.dp]
    mb = cfg.train.micro_batch_size
    if pipe is not None:  # whole micro-batches only: the schedule cuts each into its pipeline micro-batches
        mine = mine[: len(mine) // mb * mb]
    # A sharded model's forward is collective (it gathers each block's parameters), so is a pipeline's: every
    # rank runs as many batches as the busiest one, a rank short of samples repeating a batch with weight 0.
    busiest = len(everyone[:: layout.dp]) // mb * mb if pipe is not None else len(everyone[:: layout.dp])
    rounds = -(-busiest // mb) if layout.uses_mesh else -(-len(mine) // mb)
    return everyone, mine, rounds


def _forward(parts: Parts, ids: np.ndarray) -> tuple[torch.Tensor | None, dict]:
    """The loss and the recipe's eval metrics of the samples ``ids``; a loss of None on a pipeline's other stages."""
    recipe, cfg, device = parts.recipe, parts.cfg, parts.distributed.device
    what = f"recipe {cfg.recipe!r}: eval_data"
    batch = to_device(
        fetch(recipe.eval_data, ids, recipe.collate or default_collate, what=what, rank=parts.env.rank), device
    )
    pipe = parts.wrapped.pipe
    if pipe is not None:  # the loss on the last stage only; eval_metrics need the whole model
        with autocast(cfg, device), parts.wrapped.loss_context():
            return pipe.eval_loss(batch), {}
    with autocast(cfg, device), parts.wrapped.loss_context():
        loss = plain_loss(recipe.loss(parts.model, batch))
        metrics = dict(recipe.eval_metrics(parts.model, batch)) if recipe.eval_metrics else {}
    return loss, metrics


def _means(parts: Parts, totals: torch.Tensor | None, names: list[str]) -> dict[str, float]:
    """The sample-weighted means over all ranks. Collective."""
    device = parts.distributed.device
    # Every rank must bring the same vector: a rank without eval samples (more ranks than samples) brings zeros.
    width = torch.tensor([0 if totals is None else totals.numel()], device=device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    if totals is None:
        totals = torch.zeros(int(width), dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    n = float(totals[0])
    out = {"eval_loss": float(totals[1]) / n}
    for i, name in enumerate(names):
        out[f"eval_{name}"] = float(totals[2 + i]) / n
    return out
