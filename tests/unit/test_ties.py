"""Several pipeline stages on one rank (trainer/parallel/pipeline.py): a weight two of them reach through different
modules becomes a copy per stage; a module both run stays one and is reported; the merged module follows the
stages' parameters once they are replaced. A twin's optimizer state (trainer/checkpoint/compat.py): left out of
what is read, then cloned from the whole model's name, in both state-dict formats."""

import torch
from torch import nn

from trainer.checkpoint.compat import with_copies, without
from trainer.parallel.pipeline import merge, refresh, untie


class Part(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def test_a_weight_reached_through_two_modules_becomes_a_copy_per_stage():
    tok, head, shared = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False), nn.Linear(3, 3)
    head.weight = tok.weight
    first, last = Part(tok=tok, norm=shared), Part(head=head, norm=shared)
    assert untie([first, last]) == ["norm"]  # run by both: one module, reported
    assert head.weight is not tok.weight and torch.equal(head.weight, tok.weight)
    assert head.weight.requires_grad and last.norm is first.norm


def test_the_merged_module_follows_replaced_parameters():
    first, last = Part(blocks=nn.ModuleDict({"0": nn.Linear(2, 2)})), Part(blocks=nn.ModuleDict({"1": nn.Linear(2, 2)}))
    first.register_parameter("scale", nn.Parameter(torch.ones(2)))
    merged = merge([first, last])
    first.scale = nn.Parameter(torch.zeros(2))  # as fully_shard replaces a root's own parameters
    assert merged.scale is not first.scale
    refresh(merged, [first, last])
    assert merged.scale is first.scale and merged.blocks["1"] is last.blocks["1"]


def test_a_twins_optimizer_state_is_cloned_from_the_whole_models_name():
    flat = {
        "state.tok.weight.exp_avg": torch.ones(2),
        "state.head.weight.exp_avg": torch.zeros(2),
        "param_groups.tok.weight.lr": 0.1,
        "param_groups.head.weight.lr": 0.1,
    }
    read = without(flat, {"head.weight": "tok.weight"})
    assert sorted(read) == ["param_groups.tok.weight.lr", "state.tok.weight.exp_avg"]
    full = with_copies(read, {"head.weight": "tok.weight"})
    assert torch.equal(full["state.head.weight.exp_avg"], torch.ones(2)) and full["param_groups.head.weight.lr"] == 0.1
    assert full["state.head.weight.exp_avg"] is not full["state.tok.weight.exp_avg"]

    nested = {"state": {"tok.weight": {"step": torch.tensor(3.0)}}, "param_groups": [{"params": ["tok.weight"]}]}
    full = with_copies(without(nested, {"head.weight"}), {"head.weight": "tok.weight", "pos.weight": "gone.weight"})
    assert torch.equal(full["state"]["head.weight"]["step"], torch.tensor(3.0)) and "pos.weight" not in full["state"]
    assert full["param_groups"][0]["params"] == ["tok.weight", "head.weight", "pos.weight"]
