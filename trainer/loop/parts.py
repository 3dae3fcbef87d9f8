"""The parts the training loop drives, built once by ``trainer.build`` (and by the benchmarks through it)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from runconfig.schema import RunConfig
from trainer.checkpoint.state import TrainState
from trainer.data.loader import BatchLoader
from trainer.env import RuntimeEnv
from trainer.loop.stop import StopFlag
from trainer.observe.metrics import MetricsWriter
from trainer.observe.monitors import Monitors
from trainer.parallel.distributed import Distributed
from trainer.parallel.wrap import Wrapped
from trainer.recipes.api import Recipe


class Checkpoints(Protocol):
    root: Path  # the run's checkpoints/ folder
    last_save_s: float | None  # the newest committed save's seconds from save() to its commit

    def due_by_steps(self, step: int, final: bool) -> bool: ...
    def due_by_time(self) -> bool: ...
    def save(self, state: TrainState, *, block: bool) -> None: ...


@dataclass
class Parts:
    cfg: RunConfig
    env: RuntimeEnv
    distributed: Distributed
    recipe: Recipe
    model: torch.nn.Module  # the bare module (parameter names without DDP's "module."); sharded in place by FSDP
    wrapped: Wrapped  # what the loss calls, its layout and its gradient reduction
    optimizer: torch.optim.Optimizer
    lr_schedule: Callable[[int], float]  # optimizer step (0-based) -> learning rate
    loader: BatchLoader
    state: TrainState
    checkpoints: Checkpoints
    metrics: MetricsWriter
    stop: StopFlag
    mon: Monitors
    # resident host memory with the recipe built, before its model is placed (with parallel.meta_init its parameters
    # take none yet): the runtime and the data, which a host peak includes beside the training step's tensors
    runtime_mb: float | None = None

    @functools.cached_property
    def params(self) -> list[torch.nn.Parameter]:
        """The trainable parameters (clipped together)."""
        return [q for q in self.model.parameters() if q.requires_grad]

    @functools.cached_property
    def counted(self) -> list[torch.nn.Parameter]:
        """The trainable parameters the gradient norm counts: tied copies held apart (a pipeline's) once."""
        return [q for n, q in self.model.named_parameters() if q.requires_grad and n not in self.wrapped.aliases]

    @property
    def allreduce(self) -> str:
        """The gradient reduction that actually runs: "hierarchical", "flat", "fsdp", "hsdp", "replicate" or "tp"
        (see ``Wrapped.allreduce``)."""
        return self.wrapped.allreduce

    @property
    def accum(self) -> int:
        return self.loader.accum

    @property
    def units_per_step(self) -> float:
        """The recipe's units (tokens, images...) in one optimizer step over all ranks."""
        units = self.cfg.train.global_batch_size * self.recipe.units_per_sample
        return int(units) if float(units).is_integer() else units


def autocast(cfg: RunConfig, device: torch.device):
    """bf16 autocast where the config asks for it (auto: on CUDA), else nothing."""
    if cfg.train.bf16_on(device.type):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
