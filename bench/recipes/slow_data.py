"""A recipe whose dataset is slow on purpose: bench/prefetch.py's workload.

Every ``train_data[i]`` sleeps ``item_ms`` milliseconds before returning its item, like a dataset that reads each
sample from a slow file system or object store (``time.sleep`` releases the GIL, as file reads and most decoders
do, so items fetched by several threads overlap). The items are synthetic (features and the label of a fixed
random teacher, a pure function of the index), the model an MLP of ``layers`` hidden layers of ``hidden`` units:
its size sets the step's compute time, ``item_ms`` x micro-batch the fetch time of one micro-batch.

The benchmark copies this file next to the config it writes, so the submit-time code snapshot finds it there.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from trainer.recipes import Recipe, RecipeContext


class SlowItems:
    """``n`` items ``(features float32 [dim], label int64)``; each ``[i]`` takes at least ``item_ms`` ms."""

    def __init__(self, n: int, dim: int, classes: int, item_ms: float, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=gen)
        teacher = torch.randn(dim, classes, generator=gen)
        self.y = (self.x @ teacher).argmax(-1)
        self.delay_s = item_ms / 1000.0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def recipe(
    ctx: RecipeContext,
    *,
    item_ms: float = 0.0,
    items: int = 8192,
    dim: int = 256,
    hidden: int = 1024,
    layers: int = 3,
    classes: int = 16,
) -> Recipe:
    for name, value in (("items", items), ("dim", dim), ("hidden", hidden), ("layers", layers), ("classes", classes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(item_ms, bool) or not isinstance(item_ms, int | float) or item_ms < 0:
        raise ValueError(f"item_ms must be a number >= 0, got {item_ms!r}")
    dims = [dim] + [hidden] * layers
    body: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:], strict=True):
        body += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*body, nn.Linear(dims[-1], classes))
    return Recipe(
        model=model,
        train_data=SlowItems(items, dim, classes, item_ms, seed=0),  # the same items on every rank
        loss=cross_entropy,
        architecture={"dim": dim, "hidden": hidden, "layers": layers, "classes": classes},
    )
