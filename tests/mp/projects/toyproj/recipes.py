"""Recipes of a toy user project: a small MLP on synthetic points (each item a pure function of its index), with
knobs for a slow dataset and slow compute, and recipes that break one rule each (the trainer must say which)."""

from __future__ import annotations

import gc
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainer.recipes import Recipe, RecipeContext

DIM = 8


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int, *, offset: int = 0, delay: float = 0.0, ragged: bool = False) -> None:
        self.n, self.offset, self.delay, self.ragged = n, offset, delay, ragged

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.delay:
            time.sleep(self.delay)  # an I/O-bound dataset (a slow file system): the GIL is free meanwhile
        x = np.random.default_rng(i + self.offset).standard_normal(DIM + (i % 3 if self.ragged else 0))
        return torch.from_numpy(x.astype(np.float32)), int(x[:DIM].sum() > 0)


def mlp(hidden: int, dropout: float) -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 2))


def classify(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def accuracy(model: nn.Module, batch) -> dict:
    x, y = batch
    return {"accuracy": (model(x).argmax(1) == y).float().mean()}


def recipe(
    ctx: RecipeContext, hidden: int = 32, dropout: float = 0.1, n: int = 512, delay: float = 0.0, compute_s: float = 0.0
) -> Recipe:
    if hidden <= 0:
        raise ValueError(f"hidden must be a positive width, got {hidden}")

    def loss(model, batch):
        # The trainer's start-up imports run with the garbage collector off (trainer/main.py); the loop must have it
        # back, or every reference cycle a step makes would stay. Every launch of this project checks it.
        if not gc.isenabled():
            raise RuntimeError("the garbage collector is off during training")
        if compute_s:
            time.sleep(compute_s)  # a step that takes time without taking the CPU from the prefetch threads
        return classify(model, batch)

    return Recipe(
        model=mlp(hidden, dropout),
        train_data=Points(n, delay=delay),
        eval_data=Points(64, offset=10**6),
        loss=loss,
        eval_metrics=accuracy,
        unit="points",
    )


def no_params(ctx: RecipeContext) -> Recipe:
    return Recipe(model=nn.ReLU(), train_data=Points(64), loss=classify)


def empty(ctx: RecipeContext) -> Recipe:
    return Recipe(model=mlp(8, 0.0), train_data=Points(0), loss=classify)


def short(ctx: RecipeContext) -> Recipe:
    return Recipe(model=mlp(8, 0.0), train_data=Points(10), loss=classify)


def ragged(ctx: RecipeContext) -> Recipe:
    return Recipe(model=mlp(8, 0.0), train_data=Points(64, ragged=True), loss=classify)


def wrong_kind(ctx: RecipeContext):
    return {"model": mlp(8, 0.0), "train_data": Points(64), "loss": classify}


not_callable = 42


def vector_loss(ctx: RecipeContext) -> Recipe:
    def loss(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="none")

    return Recipe(model=mlp(8, 0.0), train_data=Points(64), loss=loss)


def nan_loss(ctx: RecipeContext, bad_rank: int = 1, from_call: int = 10) -> Recipe:
    """The loss turns NaN on one rank from its ``from_call``-th call on (call 1 is the start-up check)."""
    calls = [0]

    def loss(model, batch):
        calls[0] += 1
        value = classify(model, batch)
        return value * float("nan") if ctx.rank == bad_rank and calls[0] >= from_call else value

    return Recipe(model=mlp(8, 0.0), train_data=Points(512), loss=loss)


def bug_in_loss(ctx: RecipeContext, from_call: int = 6) -> Recipe:
    """A bug every rank hits from its ``from_call``-th loss call on: a dictionary lookup of a key never set."""
    calls = [0]
    extras: dict[str, torch.Tensor] = {}

    def loss(model, batch):
        calls[0] += 1
        value = classify(model, batch)
        return value * extras["weights"].mean() if calls[0] >= from_call else value

    return Recipe(model=mlp(8, 0.0), train_data=Points(512), loss=loss)


def wrong_tp_plan(ctx: RecipeContext) -> Recipe:
    """A tensor-parallel plan that splits both layers by output: the second gets half of its input features."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    return Recipe(
        model=mlp(32, 0.0),
        train_data=Points(512),
        loss=classify,
        tp_plan=lambda model: {"0": ColwiseParallel(), "3": ColwiseParallel()},
    )


def two_stages(pipeline_loss) -> Recipe:
    """The MLP as a 2-stage pipeline whose last stage computes ``pipeline_loss``."""
    from trainer.recipes import Pipeline

    return Recipe(
        model=mlp(32, 0.0),
        train_data=Points(512),
        loss=classify,
        pipeline=Pipeline(
            stage=lambda model, s, n: model[:2] if s == 0 else model[2:],  # Sequential slices keep their names
            split=lambda batch: (batch[0], batch[1]),
            loss=pipeline_loss,
        ),
    )


def vector_pipeline_loss(ctx: RecipeContext) -> Recipe:
    """A pipeline whose loss keeps one value per sample (reduction="none"), as vector_loss does without one."""
    return two_stages(lambda out, y: F.cross_entropy(out, y, reduction="none"))


def piped(ctx: RecipeContext) -> Recipe:
    """The MLP as a 2-stage pipeline, without a FLOP figure of its own: the trainer counts it (for MFU)."""
    return two_stages(F.cross_entropy)


class Sequences(torch.utils.data.Dataset):
    """Token sequences of lengths from 4 to 200 (long-tailed, as text is), with their ``lengths`` declared."""

    def __init__(self, n: int) -> None:
        self.lengths = (4 + np.random.default_rng(7).pareto(1.5, size=n) * 20).clip(max=200).astype(int)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        tokens = np.random.default_rng(i).integers(1, 50, size=int(self.lengths[i]))
        return {"tokens": torch.from_numpy(tokens), "label": int(tokens.sum() % 2)}


def varlen(ctx: RecipeContext, n: int = 512) -> Recipe:
    """Variable-length items padded per micro-batch (trainer.data.length_buckets.pad_collate): data.bucket_by_length."""
    from trainer.data.length_buckets import pad_collate

    def loss(model, batch):
        return F.cross_entropy(model(batch["tokens"], batch["attention_mask"]), batch["label"])

    return Recipe(
        model=MeanPool(), train_data=Sequences(n), loss=loss, collate=pad_collate(0, key="tokens"), unit="seq"
    )


class MeanPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(50, 16), nn.Linear(16, 2)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = mask.unsqueeze(-1).float()
        return self.out((self.emb(tokens) * keep).sum(1) / keep.sum(1))
