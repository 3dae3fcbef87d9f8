"""Context parallelism (``parallel.cp``): each sequence split over the ranks of the mesh's ``cp`` dimension, its
attention computed by torch's context-parallel ring attention (``torch.distributed.tensor.experimental.
context_parallel``: head-and-tail chunks for causal balance, keys and values passed round the group, the partial
results merged by their log-sum-exp).

Torch dispatches the ring to its CUDA attention kernels only. On the CPU, ``F.scaled_dot_product_attention`` runs
``aten._scaled_dot_product_flash_attention_for_cpu``, which the ring does not know; :func:`_enable_cpu_kernels`
gives torch's own ring (``_templated_ring_attention`` and its backward) that kernel and its backward, so the same
code path trains on CPU ranks over gloo. Pinned to torch 2.13's private ring functions; GPUs take torch's path
unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from runconfig.layout import Layout
from trainer.errors import UserError
from trainer.recipes import api
from trainer.recipes.api import ContextParallel, LossFn, Recipe

SEQ_DIM = 2  # of attention's (batch, heads, sequence, head dim) tensors
aten = torch.ops.aten


def _cpu_forward(query, key, value, *, is_causal, dropout_p=0.0, scale=None):
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, scale=scale)


def _cpu_backward(*, grad_out, query, key, value, out, logsumexp, is_causal, dropout_p=0.0, scale=None):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale
    )


def _local(x: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(x, DTensor) or x.placements != (Shard(SEQ_DIM),):
        raise RuntimeError(f"context parallelism: attention got {type(x).__name__} {getattr(x, 'placements', '')}")
    return x.to_local()


def _sharded(tensors: tuple[torch.Tensor, ...], mesh: DeviceMesh) -> tuple:
    from torch.distributed.tensor import DTensor, Shard

    return tuple(DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) for t in tensors)


def _ring_forward(op_call, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel import _attention

    q, k, v = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None or dropout_p or not is_causal:
        raise UserError(
            "parallel.cp: the model's F.scaled_dot_product_attention asks for a mask, dropout or non-causal "
            "attention; torch's ring attention under context parallelism runs causal attention only (is_causal=True, "
            "no attn_mask, dropout_p=0)."
        )
    mesh = q.device_mesh
    out = _attention._templated_ring_attention(
        mesh.get_group(), SEQ_DIM, _cpu_forward, _local(q), _local(k), _local(v),
        is_causal=is_causal, scale=kwargs.get("scale"),
    )  # fmt: skip
    return _sharded(tuple(out[:2]), mesh)


def _ring_backward(op_call, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel import _attention

    grad_out, q, k, v, out, lse, _dropout_p, is_causal = args[:8]
    mesh = q.device_mesh
    grads = _attention._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, _cpu_backward, _local(grad_out), "grad_out", _local(q), _local(k), _local(v),
        _local(out), _local(lse), is_causal, scale=kwargs.get("scale"),
    )  # fmt: skip
    return _sharded(tuple(grads[:3]), mesh)


def _enable_cpu_kernels() -> None:
    """Torch's ring attention over the CPU flash-attention kernel: added to the handlers that ``context_parallel()``
    installs in DTensor's dispatcher while it is active (and removes after)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    _attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _ring_forward
    _attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _ring_backward


@contextlib.contextmanager
def batch_loss(
    cp: SequenceSplit | None, loss: LossFn, batch: Any
) -> Iterator[Callable[[torch.nn.Module], torch.Tensor]]:
    """Yields model -> the loss of ``batch``: the recipe's, or under context parallelism (``cp``) this rank's part's,
    inside the ring (its backward must run inside too). One place for the step, the start-up pass and the plan."""
    if cp is None:
        yield lambda model: loss(model, batch)
        return
    with cp.around(batch) as part:
        yield part


def check_recipe(layout: Layout, recipe: Recipe, spec: str) -> None:
    """Under ``parallel.cp`` > 1: the recipe says how its batch splits (``Recipe.context_parallel``), and no pipeline
    runs beside it (the config refuses that too; here for a layout resolved at run time)."""
    if layout.cp == 1:
        return
    if layout.pp > 1:
        raise UserError(f"parallel.cp={layout.cp}: context parallelism beside pipeline stages ({layout.describe()}) "
                        "is not built yet; set parallel.cp: 1 or parallel.pp: 1.")  # fmt: skip
    if recipe.context_parallel is None:
        raise UserError(
            f"parallel.cp={layout.cp}: recipe {spec!r} gives no Recipe.context_parallel (how its batch splits into "
            "the model's input and targets, and its loss on a part of the sequence); add one (see "
            "trainer/recipes/api.py, the built-in GPT's trainer.models.gpt.context_parallel), or set parallel.cp: 1."
        )


class SequenceSplit:
    """A step's micro-batch, split over the ``cp`` group: :meth:`around` shards the recipe's input and targets and
    this rank's positions, and keeps torch's ring attention in place for the forward and the backward."""

    def __init__(self, mesh: DeviceMesh, spec: ContextParallel, device: torch.device) -> None:
        self.mesh, self.spec = mesh, spec
        if device.type == "cpu":
            _enable_cpu_kernels()

    @contextlib.contextmanager
    def around(self, batch: Any) -> Iterator[Callable[[torch.nn.Module], torch.Tensor]]:
        """Yields model -> this rank's loss of ``batch``; the backward must run inside too."""
        from torch.distributed.tensor.experimental import context_parallel

        inputs, targets = self.spec.split(batch)
        n = self.mesh.size()
        if inputs.shape[1] % (2 * n) or targets.shape[1] != inputs.shape[1]:
            raise UserError(
                f"parallel.cp={n}: the recipe's Recipe.context_parallel.split gives an input of sequence length "
                f"{inputs.shape[1]} and targets of {targets.shape[1]}; both must be equal and divisible by 2 x cp."
            )
        # context_parallel() resizes its buffers in place: tensors of their own, not views of the batch
        inputs, targets = inputs.clone(), targets.clone()
        where = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0)
        kept = {inputs, targets, where}
        with context_parallel(self.mesh, buffers=[inputs, targets, where], buffer_seq_dims=[1, 1, 1],
                              no_restore_buffers=kept):  # fmt: skip
            api._positions = where[0]
            try:
                yield lambda model: self.spec.loss(model(inputs), targets)
            finally:
                api._positions = None
