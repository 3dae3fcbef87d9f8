"""The batch loader (any map-style dataset, global order, prefetch threads) and the recipe checks that need no
process group."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from runconfig import load_config
from trainer.data.loader import BatchLoader, make_order
from trainer.data.order import WINDOWED, OrderSpec
from trainer.errors import UserError
from trainer.recipes.api import Recipe
from trainer.recipes.load import check_recipe
from trainer.startup.model import count_flops_per_sample
from trainer.startup.recipe import check_structure


class Squares(torch.utils.data.Dataset):
    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise KeyError(f"no item {i}")
        return torch.tensor([i, i * i], dtype=torch.float32), i % 3


ORDER = OrderSpec(WINDOWED, 4)


def loader(ds, *, prefetch: int, world: int = 2, rank: int = 0) -> BatchLoader:
    return BatchLoader(
        ds, collate=None, seed=7, order=ORDER, global_batch=8, micro_batch=2, world_size=world, rank=rank,
        device=torch.device("cpu"), prefetch=prefetch,
    )  # fmt: skip


def take(ld: BatchLoader, position: int, count: int) -> list[list[int]]:
    """The sample indices of ``count`` micro-batches from stream ``position`` (item i holds i in column 0)."""
    ld.start(position)
    return [[int(x) for x in ld.next()[0][:, 0]] for _ in range(count)]


def test_prefetch_changes_nothing_and_a_restart_continues_the_stream():
    ds = Squares(50)
    plain, fetched = loader(ds, prefetch=0), loader(ds, prefetch=3)
    try:
        a = take(plain, 0, 12)  # 12 micro-batches = 6 steps of 2 micro-batches on this rank
        assert take(fetched, 0, 12) == a
        assert take(fetched, 3 * 8, 6) == a[6:]  # from the stream position of step 3: what an uninterrupted run saw
        order = make_order(ORDER, 50, 7, None)
        first_step = order.take(0, 8)  # rank 0 of 2: blocks 0 (micro 0) and 2 (micro 1) of the step
        assert a[0] == first_step[0:2].tolist() and a[1] == first_step[4:6].tolist()
    finally:
        plain.close()
        fetched.close()


def test_a_failing_item_names_the_dataset_index_and_rank():
    ld = loader(Squares(50, fail_at=int(make_order(ORDER, 50, 7, None).take(2, 1)[0])), prefetch=2, rank=1)
    try:
        ld.start(0)
        with pytest.raises(UserError) as info:
            ld.next()
        assert str(info.value).startswith("rank 1: train_data[") and "raised KeyError" in str(info.value)
    finally:
        ld.close()


def recipe_of(**fields) -> Recipe:
    base = {"model": torch.nn.Linear(2, 3), "train_data": Squares(20), "loss": lambda m, b: m(b[0]).sum()}
    return Recipe(**{**base, **fields})


def test_structure_check_compares_neighbours_and_far_items():
    class Ragged(Squares):
        def __getitem__(self, i):
            return torch.zeros(2 + (i == 1)), 0

    check_structure("p:r", recipe_of())
    with pytest.raises(UserError, match=r"train_data items differ .* item 0 is \[.Tensor\[2\] torch.float32"):
        check_structure("p:r", recipe_of(train_data=Ragged(20)))
    check_structure("p:r", recipe_of(train_data=Ragged(20), collate=lambda items: items))  # its own collate


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"model": "net"}, "Recipe.model is a str, not a torch.nn.Module"),
        ({"model": torch.nn.ReLU()}, "has no trainable parameters"),
        ({"train_data": [1, 2, 3].__iter__()}, "is not a map-style dataset"),
        ({"loss": 3}, "Recipe.loss is not callable"),
        ({"units_per_sample": 0}, "units_per_sample must be > 0"),
    ],
)
def test_recipe_result_checks(fields, needle):
    with pytest.raises(UserError, match=needle):
        check_recipe("p:r", recipe_of(**fields))


def test_flops_per_sample_are_counted_when_the_recipe_gives_none():
    """A bias-free Linear(8 -> 4): forward 2*8*4 = 64 FLOPs per sample, backward 64 for the weight gradient (the
    input needs none); counted on fake tensors, so the model's own gradients stay untouched."""
    cfg = load_config("tiny", ["train.micro_batch_size=4", "train.global_batch_size=16"])
    model = torch.nn.Linear(8, 4, bias=False)
    data = [(np.ones(8, dtype=np.float32), 0)] * 16
    rec = recipe_of(model=model, train_data=data, loss=lambda m, b: m(b[0]).sum())
    d = types.SimpleNamespace(device=torch.device("cpu"))
    assert count_flops_per_sample(cfg, rec, d) == 128
    assert model.weight.grad is None  # the counting pass leaves no gradient behind
    assert count_flops_per_sample(cfg, recipe_of(flops_per_sample=5.0), d) == 5.0
    # counted on fake tensors: a model on the meta device counts alike (parallel.meta_init)
    on_meta = recipe_of(model=torch.nn.Linear(8, 4, bias=False, device="meta"), train_data=data, loss=rec.loss)
    assert count_flops_per_sample(cfg, on_meta, d) == 128
    # a loss that reads a value cannot run on fake tensors: no MFU, and nothing else fails
    reads = recipe_of(model=model, train_data=data, loss=lambda m, b: m(b[0]).sum() * float(m(b[0]).sum().item()))
    assert count_flops_per_sample(cfg, reads, d) is None
