"""The recipe: an MLP with dropout classifying sklearn's ``load_digits()`` images (see ../README.md).

Named in config.yaml as ``recipe: digits.train:recipe``; the trainer calls ``recipe(ctx, **recipe_args)`` on every
rank, seeds torch before the call (same initial weights everywhere), and does the distribution, checkpointing
and resume. The data ship inside scikit-learn (1,797 images): nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import os
import socket
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainer.recipes import Recipe, RecipeContext

#: Every HOLD_OUT-th image (0, 5, 10, ...) is held out for evaluation: 360 eval, 1,437 train images.
HOLD_OUT = 5
CLASSES = 10
PIXELS = 64


def load_cached(cache_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """sklearn's digits as (pixels uint8 [1797, 64], labels int64 [1797]), from ``CACHE_DIR/digits/digits-v1.npz``,
    written on first use: importing scikit-learn takes seconds on every rank of every launch, reading the file
    milliseconds. The file appears whole or not at all (written under a temporary name, then renamed), so ranks of
    concurrent runs, or of nodes that do not share the folder, each find it or make it."""
    path = Path(cache_dir) / "digits" / "digits-v1.npz"
    with contextlib.suppress(OSError, ValueError, KeyError, zipfile.BadZipFile), np.load(path) as cached:
        return cached["pixels"], cached["labels"]
    from sklearn.datasets import load_digits  # the images ship with scikit-learn

    x, y = load_digits(return_X_y=True)
    pixels, labels = x.astype(np.uint8), y.astype(np.int64)  # pixel values are the integers 0..16
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}")  # unique on a shared folder too
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, pixels=pixels, labels=labels)
        os.replace(tmp, path)
    except OSError:  # a read-only cache: load from scikit-learn every time
        with contextlib.suppress(OSError):
            tmp.unlink()
    return pixels, labels


class Digits(Dataset):
    """One split of the digits as float32 tensors, standardised per pixel with the training split's statistics.

    ``ds[i]`` is ``(image [64] float32, label int)``: the default collate makes a (float [B, 64], int64 [B]) batch.
    """

    def __init__(self, split: str, pixels: np.ndarray, labels: np.ndarray) -> None:
        held_out = np.arange(len(labels)) % HOLD_OUT == 0
        x = pixels.astype(np.float32) / 16.0  # pixel values are 0..16
        mean, std = x[~held_out].mean(0), x[~held_out].std(0)
        x = (x - mean) / np.maximum(std, 0.1)  # border pixels are (almost) always 0: do not blow them up
        keep = held_out if split == "val" else ~held_out
        self.images = torch.from_numpy(np.ascontiguousarray(x[keep]))
        self.labels = labels[keep].astype(np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], int(self.labels[i])


def mlp(hidden: int, layers: int, dropout: float) -> nn.Module:
    dims = [PIXELS] + [hidden] * layers
    body: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:], strict=True):
        body += [nn.Linear(a, b), nn.ReLU(), nn.Dropout(dropout)]
    return nn.Sequential(*body, nn.Linear(dims[-1], CLASSES))


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images).float(), labels)


def accuracy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    images, labels = batch
    return {"accuracy": (model(images).argmax(-1) == labels).float().mean()}


def tp_plan(model: nn.Module) -> dict:
    """Tensor parallelism (``parallel.tp``), Megatron-style: the Linear layers in pairs, the first split by output
    units (each rank computes its share of the hidden units; ReLU and dropout work on that share), the second by
    input units (partial sums, all-reduced). An odd last layer is split by output and its logits gathered."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    plan = {}
    for i, name in enumerate(linears):
        if i % 2:
            plan[name] = RowwiseParallel()
        else:
            plan[name] = ColwiseParallel(output_layouts=Replicate()) if i == len(linears) - 1 else ColwiseParallel()
    return plan


def recipe(ctx: RecipeContext, hidden: int = 128, layers: int = 2, dropout: float = 0.2) -> Recipe:
    for name, value in (("hidden", hidden), ("layers", layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
    with ctx.main_process_first():  # rank 0 writes the cache on first use, the others then read it
        pixels, labels = load_cached(ctx.cache_dir)
    train, val = Digits("train", pixels, labels), Digits("val", pixels, labels)
    return Recipe(
        model=mlp(hidden, layers, dropout),
        train_data=train,
        eval_data=val,
        loss=cross_entropy,
        eval_metrics=accuracy,
        unit="images",
        tp_plan=tp_plan,
    )
