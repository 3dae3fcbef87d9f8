"""AdamW's kernels (train.optimizer_impl): each choice reaches torch, each is deterministic, foreach and the loop give
the same bits, fused stays within float rounding of them, and a checkpointed state moves between them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runconfig.schema import TrainConfig
from trainer.loop.optim import build_optimizer

IMPLS = ("fused", "foreach", "for-loop")


BATCHES = [torch.randn(16, 33, generator=torch.Generator().manual_seed(i)) for i in range(12)]


def train(impl: str, batches: list[torch.Tensor] = BATCHES, state: dict | None = None) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.LayerNorm(65), torch.nn.Linear(65, 7))
    opt = build_optimizer(model, dataclasses.replace(TrainConfig(), optimizer_impl=impl))
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    for batch in batches:
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return flat, {"model": model.state_dict(), "optim": opt.state_dict()}


@pytest.mark.parametrize("impl", IMPLS)
def test_each_choice_reaches_torch_and_is_deterministic(impl):
    model = torch.nn.Linear(4, 4)
    defaults = build_optimizer(model, dataclasses.replace(TrainConfig(), optimizer_impl=impl)).defaults
    assert (defaults["fused"], defaults["foreach"]) == {
        "fused": (True, None),
        "foreach": (None, True),
        "for-loop": (None, False),
    }[impl]
    assert torch.equal(train(impl)[0], train(impl)[0])


def test_the_kernels_agree_to_rounding_and_the_state_moves_between_them():
    loop, _ = train("for-loop")
    assert torch.equal(train("foreach")[0], loop)
    fused, _ = train("fused")
    torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-6)
    # a state saved by the loop resumes under fused: the same run to rounding, as if fused from the start
    _, half = train("for-loop", BATCHES[:6])
    resumed, _ = train("fused", BATCHES[6:], state=half)
    torch.testing.assert_close(resumed, loop, rtol=1e-5, atol=1e-6)
