"""train.precision float8 (trainer/parallel/float8.py): the linear layers whose sizes allow it become torchao's
Float8Linear, keeping their parameters (names and objects: checkpoints and ties unchanged), the recipe's output layer
kept; its products emulated on CPU follow the plain layers' within float8's rounding; a CPU rank without emulation
is refused naming the key and what to set; the config refuses float8 beside tensor parallelism and an emulation
without float8."""

import pytest
import torch
from torch import nn

from runconfig import ConfigError, from_dict
from trainer.errors import UserError
from trainer.parallel.float8 import float8_problem, to_float8


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.Linear(48, 10), nn.Linear(10, 16))


def test_float8_swaps_the_layers_that_fit_and_keeps_their_parameters():
    from torchao.float8.float8_linear import Float8Linear

    m, plain = model(), model()
    before = dict(m.named_parameters())
    cpu = torch.device("cpu")
    assert to_float8(m, device=cpu, emulate=True, keep="2", spec="r", rank=0) is m
    assert [type(x).__name__ for x in m] == ["Float8Linear", "GELU", "Linear", "Linear", "Linear"]  # 2: the output
    assert dict(m.named_parameters()) == before  # the same objects under the same names; 3, 4: not multiples of 16
    first = m[0]
    to_float8(m, device=cpu, emulate=True, keep="2", spec="r", rank=0)
    assert m[0] is first  # a kept model: swapped once
    assert isinstance(m[0], Float8Linear) and type(m[0].weight) is nn.Parameter
    alone = nn.Linear(16, 16)  # a model that is one linear layer comes back swapped
    assert isinstance(to_float8(alone, device=cpu, emulate=True, keep=None, spec="r", rank=1), Float8Linear)
    x = torch.randn(8, 32)
    got, want = m(x), plain(x)
    assert not torch.equal(got, want) and torch.allclose(got, want, atol=0.05), (got - want).abs().max()
    got.sum().backward()
    assert m[0].weight.grad is not None


def test_float8_is_refused_on_cpu_without_emulation():
    assert float8_problem(torch.device("cpu"), emulate=False) == "this rank computes on the CPU"
    assert float8_problem(torch.device("cpu"), emulate=True) is None
    words = (
        r"rank 3: train.precision=float8 needs float8 matrix products, on NVIDIA GPUs of compute capability 8.9 or "
        r"newer .* and this rank computes on the CPU\. Use train.precision: bf16, or train.float8_emulate: true"
    )
    with pytest.raises(UserError, match=words):
        to_float8(model(), device=torch.device("cpu"), emulate=False, keep=None, spec="r", rank=3)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"train": {"precision": "float8"}, "parallel": {"tp": 2}}, "key 'train.precision': float8 under tensor par"),
        ({"train": {"float8_emulate": True}}, "key 'train.float8_emulate': emulates float8 matrix products, and"),
    ],
)
def test_float8_config_refusals(raw, words):
    with pytest.raises(ConfigError) as err:
        from_dict({"job": {"nodes": 1, "ranks_per_node": 2}, **raw}, source="cfg.yaml")
    assert words in str(err.value)
