"""An optimizer's kernel choice survives loading a checkpoint into it.

torch's ``Optimizer.load_state_dict`` (and DCP's ``set_state_dict``, which ends in it) replaces every param group's
settings with the saved ones, ``foreach`` and ``fused`` included. Those two choose kernels, not the optimization:
the run's config (``train.optimizer_impl``, or a recipe's own optimizer) decides them, whatever the run that wrote
the checkpoint used. Hyperparameters (lr, betas, weight decay) still come from the checkpoint, as torch has them.
"""

from __future__ import annotations

import torch

KERNEL_KEYS = ("foreach", "fused")


def kernels(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's kernel settings, to hand to :func:`restore_kernels` after a load."""
    return [{k: group[k] for k in KERNEL_KEYS if k in group} for group in optimizer.param_groups]


def restore_kernels(optimizer: torch.optim.Optimizer, kept: list[dict]) -> list[str]:
    """Put ``kept`` (from :func:`kernels` before the load) back; returns what the checkpoint had said otherwise,
    e.g. ``["fused: None -> True"]``. Where a group now runs fused (or capturable) its ``step`` counters move to its
    parameters' device, else to the CPU, where torch's own load would have put them."""
    changed: list[str] = []
    for group, settings in zip(optimizer.param_groups, kept, strict=True):
        for key, value in settings.items():
            if group.get(key) != value:
                changed.append(f"{key}: {group.get(key)} -> {value}")
        group.update(settings)
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                device = p.device if on_device else torch.device("cpu")
                if step.device != device:
                    optimizer.state[p]["step"] = step.to(device)
    return sorted(set(changed))
