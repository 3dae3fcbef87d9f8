"""``params_sha256``: one hash over the model parameters in a fixed order, to compare runs bit for bit."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import nn


def params_sha256(model: nn.Module) -> str:
    """SHA-256 over (name, dtype, shape, raw bytes) of every parameter, sorted by name; tied parameters count once.

    The definition is shared by summary.json and checkpoint manifests.
    """
    return tensors_sha256(model.named_parameters())


def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The same hash over (name, tensor) pairs, e.g. the parameters inside a CPU copy of a state dict."""
    h = hashlib.sha256()
    for name, p in sorted(named, key=lambda item: item[0]):
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).numpy()))
    return h.hexdigest()
