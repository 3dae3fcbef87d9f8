"""Pipeline parallelism for any recipe that says how to cut its model (``Recipe.pipeline``): torch's
``torch.distributed.pipelining`` stages and schedules (1F1B, GPipe) over the layout's ``pp`` mesh dimension.

What torch leaves to the caller, done here:

- **The cut.** Each rank keeps its stage's part of the model (the recipe's ``Pipeline.stage``), with the whole
  model's parameter names, so checkpoints move between layouts.
- **Weights tied across stages** (an embedding on the first stage and the output head on the last): each stage
  holds its own copy; their gradients are summed over the stages that hold one after every step, so the copies
  stay equal bit for bit. The copy under a name the whole model does not list (``head.weight`` when it is
  ``tok.weight``) is left out of the gradient norm and of ``params_sha256``, as the whole model counts it once.
- **Loss scaling.** The schedule's own gradient scaling would also rescale what earlier accumulation
  micro-batches left in ``.grad``; the loss is scaled instead, by 1 / (pipeline micro-batches x accumulation).
- **The step's loss** is known on the last stage only: it reports it weighted by ``pp`` and the other stages
  report 0, so the boundary's world mean is the mean over the last stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from runconfig.layout import Layout
from trainer.errors import UserError, first_line
from trainer.parallel.commtime import CommLedger
from trainer.recipes.api import Pipeline


@dataclass
class Pipe:
    """One rank's pipeline: its stage's schedule and what it needs around it."""

    schedule: Any
    stage: int
    stages: int
    microbatches: int
    recipe: Pipeline
    group: dist.ProcessGroup  # the pp group of this rank
    device: torch.device
    aliases: dict[str, str]  # names of tied copies the whole model does not list -> the name it lists
    tied: list[tuple[dist.ProcessGroup, nn.Parameter]] = field(default_factory=list)
    accum: int = 1  # loop micro-batches per optimizer step (set once the loader knows)
    ledger: CommLedger | None = None  # times the schedule's waits as ``pp`` (CPU)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def scaled_loss(self, output: Any, targets: Any) -> torch.Tensor:
        loss = self.recipe.loss(output, targets)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
            what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)[:200]
            raise UserError(
                f"the recipe's Pipeline.loss returned {what} on the last pipeline stage; it must return the mean "
                "loss of the pipeline micro-batch, a floating-point scalar tensor."
            )
        return loss / (self.microbatches * self.accum)

    def step(self, batch: Any) -> torch.Tensor:
        """Forward and backward of one loop micro-batch through the pipeline. Returns this rank's share of the
        step loss for the boundary's world mean: the last stage's (times ``stages``), 0 elsewhere."""
        losses: list[torch.Tensor] = []
        # Timed as pp, less the stage's own chunks (TimedStage): send/recv waits and bubble.
        with self.ledger.region("pp") if self.ledger is not None else contextlib.nullcontext():
            self._run(self.schedule.step, batch, losses)
        if not self.last:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).sum().detach() * self.stages

    def eval_loss(self, batch: Any) -> torch.Tensor | None:
        """The batch's mean loss on the last stage (forward only), None elsewhere. Collective over the pp group."""
        losses: list[torch.Tensor] = []
        self._run(self.schedule.eval, batch, losses)
        if not self.last:
            return None
        return torch.stack(losses).sum() * self.accum

    def _run(self, call: Callable, batch: Any, losses: list) -> None:
        inputs, targets = self.recipe.split(batch)
        if self.first:
            call(inputs)
        elif self.last:
            call(target=targets, losses=losses)
        else:
            call()

    def sync_tied(self) -> None:
        """Sum the gradients of weights tied across stages (after the step's last backward)."""
        from torch.distributed.tensor import DTensor

        for group, param in self.tied:
            grad = param.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor):
                # Each copy's gradient in its parameter's placements (an embedding's may come back replicated),
                # so that the ranks of a tie group add up the same pieces.
                if grad.placements != param.placements:
                    grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
                grad = grad.to_local()
            dist.all_reduce(grad, group=group)


def cut(model: nn.Module, recipe: Pipeline | None, layout: Layout, rank: int, *, spec: str) -> tuple[nn.Module, dict]:
    """This rank's stage of ``model`` and what ``schedule`` needs about the cut: the tie groups ({canonical name:
    [stages holding a copy, with the name there]}) and the aliases ({name of a tied copy: canonical name})."""
    if recipe is None:
        raise UserError(
            f"parallel.pp={layout.pp}: recipe {spec!r} does not say how to cut its model into pipeline stages. Give "
            "its Recipe a pipeline=trainer.recipes.Pipeline(stage=..., split=..., loss=...) (see "
            "trainer/recipes/api.py and the built-in GPT's trainer.models.gpt.pipeline), or use parallel.dp_shard "
            "or parallel.tp to split the model instead."
        )
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    canonical = {names[0]: names for names in groups.values() if len(names) > 1}
    aliases = {n: names[0] for names in canonical.values() for n in names[1:]}  # tied copy -> the whole model's name
    parts = []
    try:
        for s in range(layout.pp):  # every stage, on every rank: the tie groups must be the same everywhere
            part = recipe.stage(model, s, layout.pp)
            parts.append({n for n, _ in part.named_parameters(remove_duplicate=False)})
            if s == layout.coords(rank)["pp"]:
                mine = part
    except (ValueError, TypeError, IndexError, AttributeError) as exc:
        raise UserError(
            f"parallel.pp={layout.pp}: recipe {spec!r}'s Pipeline.stage failed: {first_line(exc)}"
        ) from None
    whole = {n for names in groups.values() for n in names}
    for s, names in enumerate(parts):
        strange = sorted(names - whole)
        if strange:
            raise UserError(
                f"parallel.pp={layout.pp}: recipe {spec!r}'s pipeline stage {s} has parameters the model does not "
                f"have under those names ({', '.join(strange[:4])}): a stage must keep the whole model's parameter "
                "names (hold kept blocks in an nn.ModuleDict keyed by their index)."
            )
    missing = sorted(whole - set().union(*parts))
    if missing:
        raise UserError(
            f"parallel.pp={layout.pp}: recipe {spec!r}'s pipeline stages leave out parameters "
            f"({', '.join(missing[:4])}): every parameter must be in a stage."
        )
    ties = {}
    for name, names in canonical.items():
        holders = [(s, next(n for n in names if n in parts[s])) for s in range(layout.pp) if parts[s] & set(names)]
        if len(holders) > 1:
            ties[name] = holders
    return mine, {"ties": ties, "aliases": aliases}


def schedule(
    module: nn.Module,
    layout: Layout,
    mesh: DeviceMesh,
    rank: int,
    device: torch.device,
    recipe: Pipeline,
    cut_info: dict,
    *,
    kind: str,
    microbatches: int,
    ledger: CommLedger | None = None,
) -> Pipe:
    """The schedule of this rank's stage (``module``: tensor-parallel and/or FSDP-wrapped already), and the
    groups that sum tied gradients. Collective: every rank creates every tie group in the same order. With an
    enabled ``ledger``, the schedule's waits outside the stage's own forward and backward are timed as ``pp``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = layout.coords(rank)["pp"]
    group = mesh["pp"].get_group()
    pipe = Pipe(
        schedule=None,
        stage=stage,
        stages=layout.pp,
        microbatches=microbatches,
        recipe=recipe,
        group=group,
        device=device,
        aliases=cut_info["aliases"],
        ledger=ledger if ledger is not None and ledger.enabled else None,
    )
    runner = (_timed_stage(pipe.ledger) if pipe.ledger else PipelineStage)(
        module, stage, layout.pp, device, group=group
    )
    cls = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[kind]
    pipe.schedule = cls(runner, microbatches, loss_fn=pipe.scaled_loss, scale_grads=False)
    # One group per tie and per position in the other dimensions: the ranks that differ only in their stage.
    others = _columns(layout)
    params = dict(module.named_parameters(remove_duplicate=False))
    for holders in cut_info["ties"].values():
        for column in others:
            ranks = [column[s] for s, _ in holders]
            g = dist.new_group(ranks, backend="gloo" if device.type == "cpu" else None)
            if rank in ranks:
                name = dict(holders)[stage]
                pipe.tied.append((g, params[name]))
    return pipe


def _timed_stage(ledger: CommLedger) -> type:
    """A PipelineStage whose forward and backward chunks are regions of their own, so that the ``pp`` region
    around the schedule keeps only what the schedule waits for (what the chunks wait for is FSDP2's or tensor
    parallelism's)."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with ledger.region(None):
                return super().forward_one_chunk(*args, **kwargs)

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with ledger.region(None):
                return super().backward_one_chunk(*args, **kwargs)

        def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with ledger.region(None):
                return super().backward_weight_one_chunk(*args, **kwargs)

    return TimedStage


def _columns(layout: Layout) -> list[list[int]]:
    """For each position in the non-pp dimensions, the global ranks of stages 0..pp-1 (ranks are row-major over
    (pp, dp_replicate, dp_shard, tp))."""
    per_stage = layout.world_size // layout.pp
    return [[s * per_stage + i for s in range(layout.pp)] for i in range(per_stage)]
