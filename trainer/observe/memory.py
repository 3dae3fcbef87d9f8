"""What a rank holds of the model: parameter, gradient and optimizer-state bytes of its own (local shards under
FSDP2, everything under DDP). Sharding over N ranks divides them by ~N: summary.json shows it."""

from __future__ import annotations

import torch
from torch import nn


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's own part of ``t``: a DTensor's local shard, else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(t: torch.Tensor) -> int:
    """Bytes of this rank's own part of ``t`` (its local shard of a DTensor)."""
    local = local_part(t)
    return local.numel() * local.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """{"params", "grads", "optimizer"}: bytes of this rank's own tensors (grads: as large as the parameters
    whether or not they exist right now, since they do during every step)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optim = sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {
        "params": sum(nbytes(p) for p in model.parameters()),
        "grads": sum(nbytes(p) for p in params),
        "optimizer": optim,
    }
