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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from runconfig.layout import Layout
from runconfig.schema.feasible import V_SCHEDULES
from trainer.errors import UserError, first_line
from trainer.parallel.commtime import CommLedger
from trainer.parallel.tp import plain_loss
from trainer.recipes.api import Pipeline


@dataclass
class Pipe:
    """One rank's pipeline: its stage's schedule and what it needs around it."""

    schedule: Any
    held: list[int]  # the stages this rank runs (one, or parallel.pp_stages_per_rank)
    stages: int  # of the whole pipeline: pp x stages per rank
    pp: int
    microbatches: int
    recipe: Pipeline
    group: dist.ProcessGroup  # the pp group of this rank
    device: torch.device
    aliases: dict[str, str]  # names of tied copies the whole model does not list -> the name it lists
    # each tie: the group of ranks holding copies (None: this rank's only) and this rank's copies
    tied: list[tuple[dist.ProcessGroup | None, list[nn.Parameter]]] = field(default_factory=list)
    accum: int = 1  # loop micro-batches per optimizer step (set once the loader knows)
    ledger: CommLedger | None = None  # times the schedule's waits as ``pp`` (CPU)
    evaluator: Any = None  # a forward-only schedule where the training one cannot run without backward (V)
    busy_s: float = 0.0  # wall time of this rank's own forward and backward chunks since the last take (CPU)

    @property
    def first(self) -> bool:
        """Whether this rank runs the first stage (takes the model's input)."""
        return 0 in self.held

    @property
    def last(self) -> bool:
        """Whether this rank runs the last stage (computes the loss); under a V placement the first's rank too."""
        return self.stages - 1 in self.held

    def scaled_loss(self, output: Any, targets: Any) -> torch.Tensor:
        loss = plain_loss(self.recipe.loss(output, targets))
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
            what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)[:200]
            raise UserError(
                f"the recipe's Pipeline.loss returned {what} on the last pipeline stage; it must return the mean "
                "loss of the pipeline micro-batch, a floating-point scalar tensor."
            )
        return loss / (self.microbatches * self.accum)

    def step(self, batch: Any) -> torch.Tensor:
        """Forward and backward of one loop micro-batch through the pipeline. Returns this rank's share of the
        step loss for the boundary's world mean: the last stage's (times ``pp``), 0 elsewhere."""
        losses: list[torch.Tensor] = []
        # Timed as pp, less the stage's own chunks (TimedStage): send/recv waits and bubble.
        with self.ledger.region("pp") if self.ledger is not None else contextlib.nullcontext():
            self._run(self.schedule.step, batch, losses)
        if not self.last:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).sum().detach() * self.pp

    def eval_loss(self, batch: Any) -> torch.Tensor | None:
        """The batch's mean loss on the last stage (forward only), None elsewhere. Collective over the pp group."""
        losses: list[torch.Tensor] = []
        busy = self.busy_s  # an evaluation's chunks are not the training step's
        self._run((self.evaluator or self.schedule).eval, batch, losses)
        self.busy_s = busy
        if not self.last:
            return None
        return torch.stack(losses).sum() * self.accum

    def take_busy(self) -> float:
        """Seconds this rank computed in its stages' chunks since the last take (the rest of the schedule's time
        is the bubble and the sends and receives)."""
        busy, self.busy_s = self.busy_s, 0.0
        return busy

    def _run(self, call: Callable, batch: Any, losses: list) -> None:
        inputs, targets = self.recipe.split(batch)
        if self.first and self.last:
            call(inputs, target=targets, losses=losses)
        elif self.first:
            call(inputs)
        elif self.last:
            call(target=targets, losses=losses)
        else:
            call()

    def sync_tied(self) -> None:
        """Sum the gradients of weights tied across stages (after the step's last backward): this rank's copies,
        then over the tie's ranks; every copy gets the sum."""
        from torch.distributed.tensor import DTensor

        for group, params in self.tied:
            grads = []
            for param in params:
                grad = param.grad
                if grad is None:
                    continue
                if isinstance(grad, DTensor):
                    # Each copy's gradient in its parameter's placements (an embedding's may come back replicated),
                    # so that the ranks of a tie group add up the same pieces.
                    if grad.placements != param.placements:
                        grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
                    grad = grad.to_local()
                grads.append(grad)
            if not grads and group is None:
                continue
            total = grads[0] if grads else torch.zeros_like(_local(params[0]))  # a rank without one joins anyway
            for other in grads[1:]:
                total.add_(other)
            if group is not None:
                dist.all_reduce(total, group=group)
            for param in params:  # every copy gets the sum, one that had no gradient too: the copies stay equal
                if param.grad is None:
                    param.grad = _like(param, total.clone())
                else:
                    local = _local(param.grad)
                    if local is not total:
                        local.copy_(total)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient of ``param``: a DTensor in its placements where it is one."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())  # fmt: skip
    return local


def coordinate_of(kind: str, pp: int, stage: int) -> int:
    """The pipeline coordinate of the ranks that run ``stage`` (torch's placements): in a loop (rank r runs r,
    r + pp, ...) or, for the V schedules, r and 2 pp - 1 - r."""
    if kind in V_SCHEDULES and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def merge(parts: list[nn.Module]) -> nn.Module:
    """One module over the stages a rank runs, under the whole model's names (a recipe's stages share their
    submodules with the model): what the checkpoint, the optimizer and the replica check see of this rank. A
    submodule in several stages is held once; containers the stages fill with different children (the blocks) are
    merged into a new one, so that no stage's own container changes."""
    if len(parts) == 1:
        return parts[0]
    out = nn.ModuleDict() if all(isinstance(p, nn.ModuleDict) for p in parts) else nn.Module()
    for part in parts:
        for name, param in part.named_parameters(recurse=False):
            out.register_parameter(name, param)
        for name, buffer in part.named_buffers(recurse=False):
            out.register_buffer(name, buffer)
    children: dict[str, list[nn.Module]] = {}
    for part in parts:
        for name, child in part.named_children():
            same = children.setdefault(name, [])
            if not any(child is c for c in same):
                same.append(child)
    for name, same in children.items():
        out.add_module(name, same[0] if len(same) == 1 else merge(same))
    return out


def cut(
    model: nn.Module,
    recipe: Pipeline | None,
    layout: Layout,
    rank: int,
    *,
    spec: str,
    kind: str = "1F1B",
    per_rank: int = 1,
) -> tuple[nn.Module, dict]:
    """This rank's stages of ``model`` as one module (``merge``) and what ``schedule`` needs about the cut: the
    stage modules and their indices, the tie groups ({canonical name: [stages holding a copy, with the name
    there]}) and the aliases ({name of a tied copy: canonical name})."""
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
    parts, n_stages = [], layout.pp * per_rank
    held = [s for s in range(n_stages) if coordinate_of(kind, layout.pp, s) == layout.coords(rank)["pp"]]
    mine: dict[int, nn.Module] = {}
    try:
        for s in range(n_stages):  # every stage, on every rank: the tie groups must be the same everywhere
            part = recipe.stage(model, s, n_stages)
            parts.append({n for n, _ in part.named_parameters(remove_duplicate=False)})
            if s in held:
                mine[s] = part
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
        holders = [(s, next(n for n in names if n in parts[s])) for s in range(n_stages) if parts[s] & set(names)]
        # copies on different ranks, or in different stages of one rank (untied below)
        if len({coordinate_of(kind, layout.pp, s) for s, _ in holders}) > 1 or (per_rank > 1 and len(holders) > 1):
            ties[name] = holders
    modules = [mine[s] for s in held]
    if per_rank > 1:
        _check_shared(model, modules, spec)
        shared = untie(modules)
    info = {"ties": ties, "aliases": aliases, "held": held, "modules": modules, "stages": n_stages, "kind": kind,
            "shared": shared if per_rank > 1 else []}  # fmt: skip
    return merge(modules), info


def untie(parts: list[nn.Module]) -> list[str]:
    """Give each stage module its own copy of a parameter that an earlier stage of this rank reaches through
    another module (a V placement's first and last stages: the embedding and the tied head), so that each stage
    can be an FSDP2 root of its own; the copies' gradients are summed like those of copies on other ranks
    (``Pipe.sync_tied``). The recipe's model is changed (its head holds the copy). Returns the paths of modules
    with parameters that two of the stages hold themselves (one module run by both: left shared)."""
    seen: set[int] = set()
    seen_modules: set[int] = set()
    shared: list[str] = []
    for part in parts:
        copies: dict[int, nn.Parameter] = {}
        mine = {id(p) for p in part.parameters()}
        for path, module in part.named_modules():
            direct = list(module.named_parameters(recurse=False))
            if id(module) in seen_modules:
                if direct:
                    shared.append(path)
                continue
            for attr, p in direct:
                if id(p) in seen:
                    twin = copies.setdefault(id(p), nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
                    setattr(module, attr, twin)
        seen |= mine
        seen_modules |= {id(m) for m in part.modules()}
    return shared


def refresh(merged: nn.Module, parts: list[nn.Module]) -> None:
    """Point the merged module's own parameters (those ``merge`` registered on modules of its own) at the stage
    modules' current ones, after FSDP2 replaced them in the stages it shards one by one."""
    for part in parts:
        for path, module in part.named_modules():
            target = merged.get_submodule(path)
            if target is not module:
                for name, p in module.named_parameters(recurse=False):
                    target.register_parameter(name, p)


def _check_shared(model: nn.Module, modules: list[nn.Module], spec: str) -> None:
    """Several stages on a rank are merged by their shared submodules: a recipe whose Pipeline.stage copies the
    model's parameters instead cannot hold more than one stage a rank."""
    whole = {id(p) for p in model.parameters()}
    for module in modules:
        if any(id(p) not in whole for p in module.parameters()):
            raise UserError(
                f"parallel.pp_stages_per_rank: recipe {spec!r}'s Pipeline.stage returns parameters that are not "
                "the model's own (a copy): several stages on one rank are held as one module only when each stage "
                "keeps the model's submodules themselves (as trainer.models.gpt.Stage does); set "
                "parallel.pp_stages_per_rank: 1."
            )


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
    examples: dict[int, tuple] | None = None,
) -> Pipe:
    """The schedule of this rank's stages (``module``: their merged module; each tensor-parallel and/or
    FSDP-wrapped already), and the groups that sum tied gradients. Collective: every rank creates every tie group
    in the same order. With an enabled ``ledger``, the schedule's waits outside the stages' own forward and backward
    are timed as ``pp``. ``examples``: {stage: (an input, an output, their gradients)} of one pipeline micro-batch,
    for stages that cannot learn their shapes from their neighbours (the memory plan's fake process group)."""
    import torch.distributed.pipelining as pipelining

    group = mesh["pp"].get_group()
    held, n_stages = cut_info["held"], cut_info["stages"]
    pipe = Pipe(
        schedule=None,
        held=held,
        stages=n_stages,
        pp=layout.pp,
        microbatches=microbatches,
        recipe=recipe,
        group=group,
        device=device,
        aliases=cut_info["aliases"],
        ledger=ledger if ledger is not None and ledger.enabled else None,
    )

    placed = list(zip(held, cut_info["modules"], strict=True))

    def stages(stage_class: type) -> list:
        shapes = examples or {}
        return [stage_class(part, s, n_stages, device, *shapes.get(s, ()), group=group) for s, part in placed]

    runners = stages(_timed_stage(pipe) if pipe.ledger else pipelining.PipelineStage)
    cls = getattr(pipelining, f"Schedule{kind}")
    if kind in ("1F1B", "GPipe"):  # one stage a rank
        pipe.schedule = cls(runners[0], microbatches, loss_fn=pipe.scaled_loss, scale_grads=False)
    else:
        pipe.schedule = cls(runners, microbatches, loss_fn=pipe.scaled_loss, scale_grads=False)
    if kind in V_SCHEDULES:  # their eval still runs backward actions: evaluation gets a forward-only schedule,
        # over stages of its own (sharing the training stages, its forwards changed the next step's gradients)
        own = stages(pipelining.PipelineStage)
        pipe.evaluator = _forward_only(own, microbatches, pipe.scaled_loss, kind, layout.pp)
    # One group per tie and per position in the other dimensions: the ranks that differ only in their stage.
    others = _columns(layout)
    params = dict(module.named_parameters(remove_duplicate=False))
    me = layout.coords(rank)["pp"]
    for holders in cut_info["ties"].values():
        at: dict[int, list[str]] = {}  # pipeline coordinate -> the copies' names there
        for s, name in holders:
            at.setdefault(coordinate_of(kind, layout.pp, s), []).append(name)
        here = list({id(params[n]): params[n] for n in at.get(me, [])}.values())  # this rank's copies (untie)
        if len(at) == 1:
            if len(here) > 1:
                pipe.tied.append((None, here))
            continue
        for column in others:
            ranks = [column[c] for c in sorted(at)]
            g = dist.new_group(ranks)  # the default group's backend: gloo on CPUs
            if rank in ranks:
                pipe.tied.append((g, here))
    return pipe


def _forward_only(runners: list, microbatches: int, loss_fn: Callable, kind: str, pp: int) -> Any:
    """A schedule of forwards only over these stages (``kind``'s placement): every stage's micro-batches in stage
    order, which no rank can wait on out of order. torch's runtime adds the sends and receives."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        _Action,
        _ComputationType,
        _PipelineScheduleRuntime,
    )

    mapping = {s: coordinate_of(kind, pp, s) for s in range(runners[0].num_stages)}

    class Placed(PipelineScheduleMulti):
        def _validate_and_set_stage_mapping(self, actions: dict) -> None:  # torch's check wants backwards too
            self.stage_index_to_group_rank = mapping
            for stage in self._stages:
                stage.stage_index_to_group_rank = mapping

    class ForwardOnly(_PipelineScheduleRuntime, Placed):  # the runtime's super() call reaches Placed's check
        def __init__(self) -> None:
            super().__init__(stages=runners, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
            order: dict[int, list] = {r: [] for r in range(pp)}
            for s in sorted(mapping):
                for m in range(microbatches):
                    order[mapping[s]].append(_Action(s, _ComputationType.FORWARD, m))
            self.pipeline_order = order
            self._prepare_schedule_with_comms(order)

    return ForwardOnly()


def _timed_stage(pipe: Pipe) -> type:
    """A PipelineStage whose forward and backward chunks are regions of their own, so that the ``pp`` region
    around the schedule keeps only what the schedule waits for (what the chunks wait for is FSDP2's or tensor
    parallelism's), and whose chunks' wall time adds up in ``pipe.busy_s`` (CPU: the host runs the chunk)."""
    from torch.distributed.pipelining import PipelineStage

    ledger = pipe.ledger
    assert ledger is not None

    @contextlib.contextmanager
    def chunk() -> Iterator[None]:
        started = time.perf_counter()
        try:
            with ledger.region(None):
                yield
        finally:
            pipe.busy_s += time.perf_counter() - started

    class TimedStage(PipelineStage):
        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with chunk():
                return super().forward_one_chunk(*args, **kwargs)

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with chunk():
                return super().backward_one_chunk(*args, **kwargs)

        def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with chunk():
                return super().backward_weight_one_chunk(*args, **kwargs)

    return TimedStage


def _columns(layout: Layout) -> list[list[int]]:
    """For each position in the non-pp dimensions, the global ranks of stages 0..pp-1 (ranks are row-major over
    (pp, dp_replicate, dp_shard, tp))."""
    per_stage = layout.world_size // layout.pp
    return [[s * per_stage + i for s in range(layout.pp)] for i in range(per_stage)]
