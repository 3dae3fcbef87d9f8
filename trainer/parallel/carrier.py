"""The per-step agreement carried inside DDP's gradient reduction (``comm.carry_agreement``).

Every step the ranks must agree on three numbers: the step's loss (its mean over ranks, for the record and the
non-finite check), whether any rank was asked to stop, and rank 0's time-based checkpoint trigger. A small all-reduce of
its own costs a gloo collective a step (the training thread's time to issue it, plus a socket round on every rank:
docs/measurements/overhead.md). Under DDP the step already runs one reduction that every rank joins: the
gradients'. ``Carrier`` wraps the model that DDP wraps with one extra parameter of ``SLOTS`` float32 elements, zero and
never updated, whose gradient is this rank's three numbers (``backward``: the gradient of sum(a * v) for a being v,
added to the last micro-batch's backward). DDP reduces it with the gradients, in whatever bucket and with whatever hook
runs, and after backward its gradient holds the mean over ranks: the step's own agreement, known at the step's own
boundary with no collective of its own and no deferral.

The parameter is not the model's: ``Wrapped.model`` (what the optimizer, clipping, the gradient norm, checkpoints,
fingerprints and the parameter count see) is the bare model; only DDP sees the carrier. The loss calls DDP, which
calls the carrier, which calls the model with the same arguments. The model's gradients are the same numbers: the
term adds nothing to them (its value vector is detached), and the model's loss is backpropagated unchanged."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: The carried numbers: this rank's loss of the step, its stop request (0/1), rank 0's time trigger (0/1).
SLOTS = 3


class Carrier(nn.Module):
    """``model`` as DDP sees it when the agreement rides in the gradient reduction."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.agreement = nn.Parameter(torch.zeros(SLOTS, dtype=torch.float32, device=device))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def backward(self, loss: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """``loss.backward()`` carrying ``values`` (zeros: a throw-away pass's): one backward of ``loss`` and of
        sum(agreement * values), whose gradient for ``agreement`` is ``values`` (detached, float32), for nothing
        else."""
        carried = torch.zeros(SLOTS, device=loss.device) if values is None else values.detach().to(torch.float32)
        torch.autograd.backward([loss, (self.agreement * carried).sum()])

    def read(self) -> list[float]:
        """After the step's backward: the mean over ranks of every rank's ``values``, and the gradient cleared
        (the next step's backward must not add to it)."""
        grad = self.agreement.grad
        if grad is None:
            raise RuntimeError("the agreement's gradient is missing: no synchronizing backward ran this step")
        self.agreement.grad = None
        return grad.tolist()
