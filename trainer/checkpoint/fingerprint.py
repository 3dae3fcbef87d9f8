"""``params_sha256``: one hash over the model parameters in a fixed order, to compare runs bit for bit."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import nn


def params_sha256(model: nn.Module) -> str:
    """SHA-256 over (name, dtype, shape, raw bytes) of every parameter, sorted by name; tied parameters count once.

    The definition is shared by summary.json and checkpoint manifests. Collective when the model is sharded.
    """
    return tensors_sha256(model.named_parameters())


def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The same hash over (name, tensor) pairs, e.g. the parameters inside a CPU copy of a state dict."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, p in sorted(named, key=lambda item: item[0]):
        # A sharded parameter (FSDP2's DTensor) is gathered whole, one at a time and in the same (name) order on
        # every rank: the hash does not depend on the layout. Collective then: every rank must call it.
        t = (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).numpy()))
    return h.hexdigest()
