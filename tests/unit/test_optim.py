"""AdamW's kernels (train.optimizer_impl): each choice reaches torch, each is deterministic, foreach and the loop give
the same bits, fused stays within float rounding of them, and a checkpointed state moves between them with the
loading run's kernels kept (trainer/checkpoint/kernels.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from runconfig.schema import TrainConfig
from trainer.checkpoint.kernels import kernels, restore_kernels
from trainer.loop.optim import build_optimizer

IMPLS = ("fused", "foreach", "for-loop")


BATCHES = [torch.randn(16, 33, generator=torch.Generator().manual_seed(i)) for i in range(12)]


def train(impl: str, batches: list[torch.Tensor] = BATCHES, state: dict | None = None) -> tuple[torch.Tensor, dict]:
    """``batches`` steps with ``impl``; ``state``: first load it as the checkpointer does (DCP's set_state_dict, the
    run's kernels kept)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.LayerNorm(65), torch.nn.Linear(65, 7))
    opt = build_optimizer(model, dataclasses.replace(TrainConfig(), optimizer_impl=impl))
    if state is not None:
        kept = kernels(opt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        state["differed"] = restore_kernels(opt, kept)
    for batch in batches:
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    msd, osd = get_state_dict(model, opt)
    return flat, {"model": msd, "optim": osd, "groups": [dict(g, params=None) for g in opt.param_groups]}


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
    # a state saved by the loop resumes under fused: the same run to rounding, now fused (torch's load alone would
    # have taken the checkpoint's foreach=False, fused=None)
    _, half = train("for-loop", BATCHES[:6])
    resumed, after = train("fused", BATCHES[6:], state=half)
    torch.testing.assert_close(resumed, loop, rtol=1e-5, atol=1e-6)
    assert half["differed"] == ["foreach: False -> None", "fused: None -> True"]
    assert all(g["fused"] and g["foreach"] is None for g in after["groups"])
    # and back: a fused state resumes under the loop with the loop's kernels, bit-identical to the loop's own resume
    _, half_fused = train("fused", BATCHES[:6])
    _, half_loop = train("for-loop", BATCHES[:6])
    back, after = train("for-loop", BATCHES[6:], state=half_fused)
    assert half_fused["differed"] == ["foreach: None -> False", "fused: True -> None"]
    assert all(g["foreach"] is False and not g["fused"] for g in after["groups"])
    torch.testing.assert_close(back, loop, rtol=1e-5, atol=1e-6)
    assert torch.equal(train("for-loop", BATCHES[6:], state=half_loop)[0], loop)  # same kernels: bit-exact resume
