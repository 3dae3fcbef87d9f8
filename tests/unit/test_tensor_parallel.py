"""trainer.parallel.tp on a real one-rank gloo group: a recipe without a plan, or whose plan leaves parameters
out, is refused with what to add; weights tied before tensor parallelism (an embedding and its head) stay tied.
Loss parallelism: the output layer's ColwiseParallel keeps its output split, and the loss on it under torch's
loss_parallel() equals the loss on whole logits; a recipe without an output layer, or whose plan gives that layer
anything but ColwiseParallel, is refused naming what to give."""

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


def test_loss_parallel_keeps_the_output_split_and_the_loss_equal(mesh):
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel

    from runconfig import from_dict
    from trainer.parallel.tp import plain_loss, tensor_parallel
    from trainer.parallel.wrap import output_layer
    from trainer.recipes.api import Recipe

    def plan(model):
        return {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }

    idx, targets = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[2, 3, 4, 5]])
    whole, split = Tied(), Tied()
    split.load_state_dict(whole.state_dict())
    tensor_parallel(whole, plan, mesh, recipe="mine:r")
    tensor_parallel(split, plan, mesh, recipe="mine:r", split_output="out")
    assert not isinstance(whole(idx), DTensor)
    with loss_parallel():
        logits = split(idx)
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)  # the class dimension
        loss = plain_loss(F.cross_entropy(logits.view(-1, 10), targets.view(-1)))
        loss.backward()
    want = F.cross_entropy(whole(idx).view(-1, 10), targets.view(-1))
    want.backward()
    assert not isinstance(loss, DTensor) and torch.allclose(loss, want)
    # the same gradients up to the order of the sums (values ~1e-3)
    assert torch.allclose(split.emb.weight.grad.full_tensor(), whole.emb.weight.grad.full_tensor(), atol=1e-7)

    with pytest.raises(UserError, match=r"output_layer 'out' has RowwiseParallel in its tp_plan; loss paral"):
        tensor_parallel(Tied(), lambda m: {**plan(m), "out": RowwiseParallel()}, mesh, recipe="mine:r",
                        split_output="out")  # fmt: skip
    cfg = from_dict({"parallel": {"tp": 2, "loss_parallel": True}, "job": {"ranks_per_node": 2}})
    recipe = Recipe(model=Tied(), train_data=[], loss=lambda m, b: m(b))
    with pytest.raises(UserError, match=r"recipe 'gpt' gives no Recipe.output_layer\. Loss parallelism keeps"):
        output_layer(cfg, recipe.model, recipe)
    recipe.output_layer = "head"
    with pytest.raises(UserError, match=r"names output_layer='head', not a module\. Loss parallelism"):
        output_layer(cfg, recipe.model, recipe)
    recipe.output_layer = "out"
    assert output_layer(cfg, recipe.model, recipe) == "out"
    recipe.eval_metrics = lambda m, b: {"accuracy": (m(b[0]).argmax(-1) == b[1]).float().mean()}
    with pytest.raises(UserError, match=r"has eval_metrics, which would get the logits split by class over the ten"):
        output_layer(cfg, recipe.model, recipe)
