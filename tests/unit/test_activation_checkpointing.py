"""Activation checkpointing on a recipe's blocks (trainer/parallel/fsdp.py): every mode gives the gradients of the
plain model bit for bit (dropout replayed), and recomputes what it should in backward: full and selective
(every other block) run the blocks' forward again, matrix products included; per-op keeps the products' and
attention's outputs and recomputes only the element-wise ops."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runconfig import load_config
from trainer.models.gpt import GPT, loss_fn
from trainer.parallel.fsdp import checkpoint_blocks, find_blocks

LAYERS = 4


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def run(mode: str) -> tuple[dict[str, torch.Tensor], int, dict[str, int]]:
    """(gradients, blocks changed, ops run during backward) of one forward/backward in ``mode``."""
    cfg = load_config("tiny", ["model.d_model=32", f"model.n_layers={LAYERS}", "model.seq_len=16", "model.dropout=0.1"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    changed = checkpoint_blocks(find_blocks(model, None, recipe="gpt"), mode)
    batch = torch.randint(0, cfg.model.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # dropout
    loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
    with Count() as backward:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, changed, backward.calls


@pytest.fixture(scope="module")
def plain():
    return run("none")


@pytest.mark.parametrize(("mode", "changed"), [("full", LAYERS), ("selective", LAYERS // 2), ("op", LAYERS)])
def test_every_mode_gives_the_gradients_of_the_plain_model(plain, mode, changed):
    grads, n, _ = run(mode)
    assert n == changed
    assert grads.keys() == plain[0].keys()
    for name, g in grads.items():
        assert torch.equal(g, plain[0][name]), name


def test_what_each_mode_recomputes(plain):
    products = ("mm", "addmm", "bmm")
    base = plain[2]
    assert base.get("gelu", 0) == 0  # nothing recomputed: gelu_backward only
    for mode, blocks in (("full", LAYERS), ("selective", LAYERS // 2)):
        calls = run(mode)[2]
        assert calls.get("gelu", 0) == blocks, (mode, calls)  # each recomputed block's MLP activation, once
        assert sum(calls.get(p, 0) for p in products) > sum(base.get(p, 0) for p in products), mode
    calls = run("op")[2]
    assert calls.get("gelu", 0) == LAYERS, calls  # the element-wise ops are recomputed in every block
    assert sum(calls.get(p, 0) for p in products) == sum(base.get(p, 0) for p in products)  # the products are not


@pytest.mark.parametrize("mode", ["none", "op"])
def test_compiled_blocks_are_traced_and_train_alike(plain, mode):
    """parallel.compile: each block's forward (its checkpointing included) goes through torch.compile: dynamo traces
    a graph (checkpoint called directly is opaque to it) and the gradients match the eager ones."""
    from torch._dynamo.utils import counters

    from trainer.parallel.wrap import compile_blocks

    cfg = load_config("tiny", ["model.d_model=32", f"model.n_layers={LAYERS}", "model.seq_len=16", "model.dropout=0"])
    grads = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg.model)
        blocks = find_blocks(model, None, recipe="gpt")
        checkpoint_blocks(blocks, mode)
        torch._dynamo.reset()
        counters.clear()
        compile_blocks(model, blocks, compiled)
        batch = torch.randint(0, cfg.model.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
        loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
        grads[compiled] = {n: p.grad for n, p in model.named_parameters()}
        assert (counters["stats"]["unique_graphs"] > 0) == compiled, dict(counters["stats"])
    for name, g in grads[True].items():
        assert torch.allclose(g, grads[False][name], rtol=1e-4, atol=1e-6), name


def test_a_kept_model_wrapped_again_keeps_its_recomputation_and_compiled_code():
    """An in-process restart (job.spare_ranks) keeps a survivor's model and wraps it again in the next generation:
    each block keeps its one activation checkpoint and its compiled forward, rather than a second one around them
    (a block recomputed twice over, or traced again)."""
    from trainer.parallel.wrap import compile_blocks

    cfg = load_config("tiny", ["model.d_model=32", f"model.n_layers={LAYERS}", "model.seq_len=16"])
    model = GPT(cfg.model)
    blocks = find_blocks(model, None, recipe="gpt")
    forwards = []
    for _generation in range(2):
        assert checkpoint_blocks(blocks, "full") == LAYERS
        compile_blocks(model, blocks, True)
        forwards.append([b.forward for b in blocks])
    assert forwards[0] == forwards[1]
