"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from runconfig.schema import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **adamw_impl(cfg.optimizer_impl))


def adamw_impl(name: str) -> dict[str, bool]:
    """torch.optim.AdamW's keyword arguments for ``train.optimizer_impl`` (the same in bench/plain_ddp.py)."""
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[name]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine decay to ``min_lr``.

    A pure function of the step, so resuming needs only the step number.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    *,
    across: dist.ProcessGroup | None = None,
    counted: list[nn.Parameter] | None = None,
) -> torch.Tensor:
    """Clip the global gradient norm; returns the norm before clipping, a plain tensor. Sharded gradients (FSDP2's
    and tensor parallelism's DTensors) give a partial norm per rank: it is reduced over their mesh first
    (torchtitan does the same), per mesh where the parameters live on several. ``across``: the pipeline group
    whose stages' norms combine; ``counted``: the parameters the norm counts (default ``params``: all of them,
    all clipped)."""
    from torch.distributed.tensor import DTensor

    if across is None and not any(isinstance(p, DTensor) for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    by_mesh: dict = {}  # DTensors of different meshes (or plain tensors) do not mix in one norm
    for p in params if counted is None else counted:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        total = norms[0]
    else:  # several meshes, or a pipeline stage without gradients of its own (zero)
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if across is not None:  # pipeline stages hold different parameters: the sum of squares over them
        total = total.square()
        dist.all_reduce(total, group=across)
        total = total.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
