"""``params_sha256``: one hash over the model parameters in a fixed order, to compare runs bit for bit."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def params_sha256(model: nn.Module) -> str:
    """SHA-256 over (name, dtype, shape, raw bytes) of every parameter, sorted by name; tied parameters count once.

    The definition is shared by summary.json and checkpoint manifests.
    """
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda item: item[0]):
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
