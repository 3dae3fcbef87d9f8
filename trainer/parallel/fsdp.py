"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and activation checkpointing for any recipe's model.

The unit of both is a *block*: the recipe's ``fsdp_wrap`` classes, else each child of the model's largest
``nn.ModuleList`` or ``nn.ModuleDict`` (the transformer layers of most models; a pipeline stage's). Each block is
sharded on its own (its parameters are gathered just before it runs and freed after, so at most a block or two
is whole at a time), then the root takes what is left (embeddings, final norm, a head tied to the embedding).
With a 2-D (dp_replicate, dp_shard) mesh this is HSDP: shards inside a group, gradients reduce-scattered there
and all-reduced across the replicas once.

Parameter names do not change (the checkpoint's keys and ``params_sha256`` stay those of the bare model), which is
why activation checkpointing replaces the block's ``forward`` rather than wrapping the block in a new module.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.errors import UserError
from trainer.parallel.commtime import CommLedger


def find_blocks(model: nn.Module, classes: Sequence[type] | None, *, recipe: str) -> list[nn.Module]:
    """The blocks to shard (and checkpoint) one by one, in model order."""
    if classes:
        blocks = [m for m in model.modules() if isinstance(m, tuple(classes)) and m is not model]
        if not blocks:
            names = ", ".join(c.__name__ for c in classes)
            raise UserError(f"recipe {recipe!r}: fsdp_wrap names {names}, but the model has no module of that class.")
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList | nn.ModuleDict) and len(m)]
    if not lists:
        return []
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(largest.children())


def checkpoint_blocks(blocks: list[nn.Module], mode: str) -> int:
    """Recompute activations in backward instead of keeping them: every block's (``full``), every other block's
    (``selective``), or in every block all but the matrix products' and attention's outputs (``op``: per-op
    selective checkpointing, which recomputes only the cheap element-wise ops: norms, activations, dropout).
    Returns how many blocks recompute. Random numbers (dropout) are replayed exactly. A block done before (a model
    kept by an in-process restart, wrapped again in the next generation) is left as it is."""
    if mode == "none":
        return 0
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    chosen = blocks[::2] if mode == "selective" else blocks
    options: dict = {"use_reentrant": False}
    if mode == "op":
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_products)
    for block in chosen:
        if not getattr(block, "_hpc_recomputed", False):
            block.forward = _recomputed(checkpoint, block.forward, options)
            block._hpc_recomputed = True
    return len(chosen)


def _recomputed(checkpoint, forward, options: dict):
    """``forward`` under activation checkpointing, as a plain function: ``torch.compile`` traces it (and turns the
    checkpoint into its higher-order op), where it cannot enter ``checkpoint`` called directly."""

    def run(*args, **kwargs):
        return checkpoint(forward, *args, **options, **kwargs)

    return run


@functools.cache
def _saved_ops() -> frozenset:
    """The ops whose outputs per-op checkpointing keeps: matrix products, attention, and collectives (recomputing
    a collective would run it again), as torchtitan's list."""
    aten = torch.ops.aten
    names = [
        (aten, "mm"), (aten, "addmm"), (aten, "bmm"), (aten, "baddbmm"), (aten, "_scaled_mm"),  # float8's too
        (aten, "_scaled_dot_product_flash_attention"), (aten, "_scaled_dot_product_efficient_attention"),
        (aten, "_scaled_dot_product_cudnn_attention"), (aten, "_scaled_dot_product_flash_attention_for_cpu"),
        (torch.ops._c10d_functional, "reduce_scatter_tensor"), (torch.ops._c10d_functional, "all_gather_into_tensor"),
        (torch.ops._c10d_functional, "all_reduce"),
    ]  # fmt: skip
    return frozenset(getattr(ns, name).default for ns, name in names if hasattr(ns, name))


def _keep_products(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def shard(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    ledger: CommLedger | None = None,
    offload: bool = False,
) -> None:
    """fully_shard every block, then the root. ``param_dtype`` (bf16 where the run computes in bf16) is the compute
    dtype of the gathered parameters; gradients are reduced in fp32 and the sharded parameters and optimizer state
    stay fp32. With an enabled ``ledger``, FSDP2's all-gathers and reduce-scatters are timed into it (the same
    collectives). ``offload``: the shards (parameters, gradients, so the optimizer state) live in host memory,
    pinned where the mesh is on a GPU (pinning needs one)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    where = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered (torchtitan).
        last = i == len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=where,
                    reshard_after_forward=reshard_after_forward and not last)  # fmt: skip
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=where, reshard_after_forward=reshard_after_forward)
    if ledger is not None and ledger.enabled:
        for module in [*blocks, model]:
            module.set_custom_all_gather(TimedAllGather(ledger))  # type: ignore[operator]
            module.set_custom_reduce_scatter(TimedReduceScatter(ledger))  # type: ignore[operator]


class _TimedWork(dist.Work):
    """An asynchronous all-gather's handle: FSDP2 waits on it before the block runs; the wait is timed."""

    def __init__(self, work: dist.Work, ledger: CommLedger) -> None:
        super().__init__()
        self.work, self.ledger = work, ledger

    def wait(self, timeout=None) -> bool:  # noqa: ANN001 (c10d's signature)
        with self.ledger.region("dp_shard"):
            return self.work.wait() if timeout is None else self.work.wait(timeout)


class _TimedComm:
    """FSDP2's custom-collective interface: plain buffers; each call timed into the ledger as ``dp_shard``."""

    def __init__(self, ledger: CommLedger) -> None:
        self.ledger = ledger

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class TimedAllGather(_TimedComm):
    """FSDP2's all-gather (``FSDPModule.set_custom_all_gather``): the default one, timed as ``dp_shard``."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        with self.ledger.region("dp_shard"):
            work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        return _TimedWork(work, self.ledger) if work is not None else None


class TimedReduceScatter(_TimedComm):
    """FSDP2's reduce-scatter of gradients (``FSDPModule.set_custom_reduce_scatter``), timed as ``dp_shard``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        with self.ledger.region("dp_shard"):  # FSDP2 calls it synchronously
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
