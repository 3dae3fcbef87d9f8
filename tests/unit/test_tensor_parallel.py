"""trainer.parallel.tp on a real one-rank gloo group: a recipe without a plan, or whose plan leaves parameters
out, is refused with what to add; weights tied before tensor parallelism (an embedding and its head) stay tied."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainer.errors import UserError


@pytest.fixture
def mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(self.norm(self.emb(idx)))


def test_tensor_parallel_refuses_a_missing_or_partial_plan_and_keeps_ties(mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from trainer.parallel.tp import tensor_parallel

    with pytest.raises(UserError, match=r"parallel.tp=1: recipe 'mine:r' gives no tensor-parallel plan\. Give its"):
        tensor_parallel(Tied(), None, mesh, recipe="mine:r")

    def partial(model):
        return {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }

    with pytest.raises(UserError, match=r"tp_plan leaves parameters outside tensor parallelism: norm.weight, norm.b"):
        tensor_parallel(Tied(), partial, mesh, recipe="mine:r")

    model = Tied()
    tensor_parallel(model, lambda m: {**partial(m), "norm": SequenceParallel()}, mesh, recipe="mine:r")
    assert model.out.weight is model.emb.weight and isinstance(model.emb.weight, DTensor)
    assert model.emb.weight.placements == (Shard(0),)
    assert [n for n, _ in model.named_parameters()] == ["emb.weight", "norm.weight", "norm.bias"]
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    assert model.emb.weight.grad is not None

    with pytest.raises(
        UserError, match=r"tp_plan could not be applied: ValueError: the key 'blocks.\*.nope' matches no module"
    ):
        tensor_parallel(Tied(), lambda m: {"blocks.*.nope": ColwiseParallel()}, mesh, recipe="mine:r")
