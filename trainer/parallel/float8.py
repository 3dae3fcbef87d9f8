"""``train.precision: float8``: the model's linear layers swapped for torchao's ``Float8Linear`` (dynamic
per-tensor scales; torchtitan's float8 training), before tensor parallelism and FSDP2 wrap them. The weights stay
the same parameters (fp32, under bf16 autocast or FSDP2's bf16 policy), so names, checkpoints and resume do not
change; only the matrix products run in float8. torchao is imported only here, and only for float8 runs."""

from __future__ import annotations

import logging

import torch
from torch import nn

from trainer.errors import UserError, first_line

log = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards


def float8_problem(device: torch.device, emulate: bool) -> str | None:
    """Why this rank cannot run float8 matrix products (None when it can)."""
    if emulate:
        return None
    if device.type != "cuda":
        return "this rank computes on the CPU"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"this rank's GPU, {name}, has compute capability {capability[0]}.{capability[1]}"
    return None


def to_float8(
    model: nn.Module,
    *,
    device: torch.device,
    emulate: bool,
    keep: str | None,
    spec: str,
    rank: int,
    report: bool = True,
) -> nn.Module:
    """Swap ``model``'s linear layers for Float8Linear in place, all but ``keep`` (the recipe's output layer: its
    logits stay bf16, as torchtitan's) and those whose sizes are not multiples of 16 (float8 matrix products need
    them); returns the model (a new module where the model itself was a linear layer). A layer swapped before (a
    model kept by an in-process restart) is left as is. ``report``: rank 0 logs how many layers are in float8."""
    problem = float8_problem(device, emulate)
    if problem is not None:
        raise UserError(
            f"rank {rank}: train.precision=float8 needs float8 matrix products, on NVIDIA GPUs of compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (H100, H200, L40S), and {problem}. Use "
            "train.precision: bf16, or train.float8_emulate: true to emulate them (tests; no speed-up)."
        )
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 11):
        raise UserError(
            f"rank {rank}: train.precision=float8 needs torch 2.11 or newer for torchao's float8 training; this is "
            f"torch {torch.__version__}."
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise UserError(
            f"rank {rank}: train.precision=float8 needs torchao ({first_line(exc)}): pip install torchao (envs/"
            "requirements-cuda.txt names it)."
        ) from None

    def chosen(module: nn.Module, path: str) -> bool:
        return (
            type(module) is nn.Linear
            and path != keep
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    if any(chosen(m, path) for path, m in model.named_modules()):
        model = convert_to_float8_training(model, module_filter_fn=chosen, config=Float8LinearConfig(emulate=emulate))
    if report and rank == 0:
        n = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        log.info("train.precision=float8: %d linear layers in float8%s", n, " (emulated)" if emulate else "")
        if keep is None:
            log.warning("train.precision=float8: recipe %r names no Recipe.output_layer, so its output layer (if a "
                        "linear one) computes in float8 too; torchtitan keeps it in bf16", spec)  # fmt: skip
    return model
