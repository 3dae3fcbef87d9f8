"""``python -m trainer.plan CONFIG [--set KEY=VALUE ...] [--nodes N] [--ranks-per-node R]``: each rank's memory
for the config's layout, at the job's world size or any other (4,096 ranks included), before the job starts and
without a GPU. The recipe's model is built on the meta device and split by the trainer's own code (its pipeline
stage, tensor parallelism, FSDP2's sharding, activation checkpointing) for one rank of a fake process group of the
planned world; then two training steps run over fake tensors (shapes only: nothing is allocated, nothing computed)
under torch's memory trackers (FSDPMemTracker for FSDP2's layouts, MemTracker otherwise), which report the bytes
live at the step's peak by kind. The second step's peak is the plan's: it holds the optimizer's state."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

from runconfig import ConfigError, RunConfig, load_config
from runconfig.layout import Layout
from runconfig.schema.feasible import SPLIT_BACKWARD
from trainer.errors import UserError
from trainer.parallel.tp import plain_loss, retie, tied_groups

MIB = 2**20
KINDS = ("params", "grads", "optimizer", "activations", "comm", "buffers")


@dataclass
class RankPlan:
    """Bytes one rank holds at the peak of a training step, by kind (``comm``: FSDP2's all-gather and
    reduce-scatter buffers, DDP's gradient buckets), and the peak itself."""

    rank: int
    pp: int  # the rank's pipeline coordinate
    params: int
    grads: int
    optimizer: int
    activations: int  # saved for backward and the temporaries alive with them (the micro-batch's inputs included)
    comm: int
    buffers: int
    peak: int


def layout_for(cfg: RunConfig, world_size: int) -> Layout:
    from trainer.parallel.wrap import layout_of

    env = SimpleNamespace(world_size=world_size, topology=SimpleNamespace(num_nodes=cfg.job.nodes,
                          ranks_per_node=cfg.job.ranks_per_node))  # fmt: skip
    return layout_of(cfg, env)


def plan(cfg: RunConfig, world_size: int, coordinate: int = 0) -> tuple[Layout, RankPlan]:
    """The plan of the first rank of pipeline coordinate ``coordinate`` (the ranks of one coordinate hold alike).
    One coordinate a process: DTensor caches meshes across fake worlds (``main`` runs one process each)."""
    layout = layout_for(cfg, world_size)
    kind = cfg.parallel.pp_schedule
    if layout.pp > 1 and kind in SPLIT_BACKWARD:
        raise UserError(
            f"parallel.pp_schedule={kind}: the memory plan does not cover the zero-bubble schedules yet (their "
            "backward, split into input and weight gradients, does not run on fake tensors); plan the layout with "
            "Interleaved1F1B, which holds the same stages, or measure a short run (summary.json memory_mb_per_rank)."
        )
    if not 0 <= coordinate < layout.pp:
        raise UserError(f"--coordinate {coordinate}: the layout has pipeline coordinates 0-{layout.pp - 1}")
    recipe, batch = _recipe_and_batch(cfg)
    rank = next(r for r in range(world_size) if layout.coords(r)["pp"] == coordinate)
    return layout, _plan_rank(cfg, layout, recipe, batch, rank=rank, world_size=world_size)


def _recipe_and_batch(cfg: RunConfig):
    """The recipe built as a rank builds it, its model's parameters on the meta device, and its first micro-batch
    (the data is read as rank 0 of the job would)."""
    from mpi4py import MPI

    from trainer.data.loader import fetch
    from trainer.env import from_mpi
    from trainer.parallel.materialise import params_on_meta
    from trainer.recipes.load import build_recipe
    from trainer.startup.recipe import recipe_context

    env = from_mpi(MPI.COMM_SELF)
    with contextlib.ExitStack() as stack:
        run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hpc-plan-")))
        ctx = recipe_context(cfg, env, torch.device("cpu"), run_dir, MPI.COMM_SELF, stack)
        torch.manual_seed(cfg.train.seed)
        with params_on_meta():
            recipe = build_recipe(cfg.recipe, dict(cfg.recipe_args), ctx)
        ids = np.arange(min(cfg.train.micro_batch_size, len(recipe.train_data)))
        batch = fetch(recipe.train_data, ids, recipe.collate or default_collate, what="train_data", rank=0)
    return recipe, batch


def _plan_rank(cfg: RunConfig, layout: Layout, recipe, batch, *, rank: int, world_size: int) -> RankPlan:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._pytree import tree_map

    from trainer.loop.optim import build_optimizer, clip_grad_norm
    from trainer.loop.parts import autocast
    from trainer.parallel.commtime import CommLedger
    from trainer.parallel.cp import SequenceSplit, batch_loss, check_recipe
    from trainer.parallel.mesh import train_mesh
    from trainer.parallel.pipeline import schedule
    from trainer.parallel.tp import tensor_parallel
    from trainer.parallel.wrap import data_parallel_over_mesh, output_layer, stage_and_blocks, stages_of

    device = torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = train_mesh(layout, device)  # outside the fake mode: the mesh's own tensors are real
        model = copy.deepcopy(recipe.model)
        mode = FakeTensorMode(allow_non_fake_inputs=True)  # the mesh's rank tables are real
        with mode, _apart():
            _fake_parameters(model, device)  # the whole model's, allocating nothing: split below as a rank splits it
            fake_batch = tree_map(lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, batch)
            split_output = output_layer(cfg, model, recipe)
            examples = None
            if layout.pp > 1:
                tp = (mesh["tp"], split_output) if layout.tp > 1 else None
                examples = _stage_examples(cfg, layout, model, recipe, fake_batch, device, tp)
            model, cut_info, blocks = stage_and_blocks(cfg, SimpleNamespace(rank=rank), model, recipe, layout, device)
            if layout.tp > 1:
                tensor_parallel(model, recipe.tp_plan, mesh["tp"], recipe=cfg.recipe, split_output=split_output)
            no_sync, fsdp = contextlib.nullcontext, False
            if mesh is not None and (layout.dp > 1 or layout.cp > 1):
                distributed = SimpleNamespace(device=device, ledger=CommLedger())
                _, no_sync = data_parallel_over_mesh(cfg, distributed, model, blocks, mesh, layout, stages_of(cut_info))
                fsdp = True
            pipe = None
            if cut_info is not None:
                pipe = schedule(model, layout, mesh, rank, device, recipe.pipeline, cut_info,
                                kind=cfg.parallel.pp_schedule, microbatches=cfg.parallel.microbatches(layout.pp),
                                examples=examples)  # fmt: skip
            optimizer = build_optimizer(model, cfg.train)
            if fsdp and pipe is None:  # it follows one forward of the root at a time: a schedule runs several
                tracker = FSDPMemTracker(model, optimizer)
            else:
                tracker = _tracker(MemTracker)()
                tracker.track_external(model, optimizer)
            accum = cfg.grad_accum(world_size)
            if pipe is not None:
                pipe.accum = accum
            loss_context = _loss_context(split_output)
            check_recipe(layout, recipe, cfg.recipe)
            cp = SequenceSplit(mesh["cp"], recipe.context_parallel, device) if layout.cp > 1 else None
            params = [p for p in model.parameters() if p.requires_grad]
            with tracker:
                for _ in range(2):
                    for micro in range(accum):
                        tracker.reset_mod_stats()  # per module: FSDPMemTracker takes one forward at a time
                        with (
                            no_sync() if micro < accum - 1 else contextlib.nullcontext(),
                            loss_context(),
                            batch_loss(cp, recipe.loss, fake_batch) as loss_of,
                        ):
                            with autocast(cfg, device):
                                if pipe is not None:
                                    pipe.step(fake_batch)
                                    continue
                                loss = plain_loss(loss_of(model))
                            (loss / accum).backward()
                    if pipe is not None:
                        pipe.sync_tied()
                    clip_grad_norm(params, cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf"),
                                   across=pipe.group if pipe else None)  # fmt: skip
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    by_kind = _by_kind(next(iter(peak.values())) if peak else {})
    if mesh is None and layout.dp > 1:  # DDP's reducer (C++, out of a tracker's sight) keeps its buckets: a flat
        by_kind["comm"] += sum(p.numel() * p.element_size() for p in params)  # copy of every gradient
    return RankPlan(rank=rank, pp=layout.coords(rank)["pp"], **by_kind, peak=sum(by_kind.values()))


def _tracker(base: type) -> type:
    """torch's MemTracker, for a root module called several times a step (a pipeline stage, once per pipeline
    micro-batch): its statistics per module start again at each call, where the base refuses the second one. The
    step's peak, which the plan reports, is the tracker's over all calls."""

    class Tracker(base):
        def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                parents = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
                if parents == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return Tracker


def _stage_examples(
    cfg: RunConfig, layout: Layout, model: nn.Module, recipe, batch, device, tp: tuple | None
) -> dict[int, tuple]:
    """{stage: (its input, its output, their gradients)} for one pipeline micro-batch, from the stages of the whole
    (fake) model run in turn: a pipeline stage is built with them instead of learning them from its neighbours
    (which a fake process group cannot tell it). ``tp``: (the tensor-parallel mesh, the loss-parallel output layer)
    where each stage is split as its ranks split it (what passes between stages is then their local pieces: the
    GPT's, a sequence split), on a copy of the model."""
    from trainer.loop.parts import autocast
    from trainer.parallel.tp import tensor_parallel

    if tp is not None:
        model = copy.deepcopy(model)
    p = cfg.parallel
    n_stages, m = layout.pp * p.pp_stages_per_rank, p.microbatches(layout.pp)
    inputs, _ = recipe.pipeline.split(batch)
    x = inputs.chunk(m)[0]
    out = {}
    with torch.no_grad(), autocast(cfg, device):
        for s in range(n_stages):
            part = recipe.pipeline.stage(model, s, n_stages)
            if tp is not None:
                tensor_parallel(part, recipe.tp_plan, tp[0], recipe=cfg.recipe, split_output=tp[1])
            y = part(x)
            if y.is_floating_point():  # the activation the next stage receives, whose gradient it sends back
                y = y.detach().requires_grad_(True)
            # (input, output, the gradient it receives for its output, the one it sends back for its input)
            out[s] = (x, y, torch.empty_like(y), torch.empty_like(x) if x.is_floating_point() else None)
            x = y
    return out


def _fake_parameters(model: nn.Module, device: torch.device) -> None:
    """Fake tensors (inside the active FakeTensorMode) in place of the whole model's meta parameters and buffers,
    ties kept (before any split: the split then makes its DTensors of them)."""
    ties = tied_groups(model)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                new = torch.empty(p.shape, dtype=p.dtype, device=device)
                module._parameters[name] = nn.Parameter(new, requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    retie(model, ties)


@contextlib.contextmanager
def _apart():
    """What a fake process group and fake tensors need besides: meshes made inside the fake mode (FSDP2 joins the
    data-parallel and tensor-parallel ones) hold real rank tables; DTensor's sharding propagation (whole-tensor
    shapes) computes on fake tensors of a mode of its own, which the trackers skip, instead of the active one;
    pipeline stages take the shapes they are given."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import _utils as pipe_utils
    from torch.distributed.pipelining import schedules
    from torch.distributed.tensor import _sharding_prop

    original, detect = DeviceMesh.__init__, _sharding_prop.detect_fake_mode
    warmup = schedules._PipelineSchedule._warmup_p2p

    def init(self, *args, **kwargs):
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    def static(self, stages, has_backward, p2p_done) -> None:
        # The stages' vote on how to learn their shapes reads a value back; they are given theirs (examples)
        for stage in stages:
            stage._inference_mode = pipe_utils.InferenceMode.STATIC

    DeviceMesh.__init__ = init
    _sharding_prop.detect_fake_mode = lambda *args: None
    schedules._PipelineSchedule._warmup_p2p = static
    try:
        yield
    finally:
        DeviceMesh.__init__, _sharding_prop.detect_fake_mode = original, detect
        schedules._PipelineSchedule._warmup_p2p = warmup


def _loss_context(split_output: str | None):
    if split_output is None:
        return contextlib.nullcontext
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel


def _by_kind(snapshot: dict) -> dict[str, int]:
    """The trackers' categories (FSDPMemTracker's and MemTracker's names) summed into the plan's kinds."""
    out = dict.fromkeys(KINDS, 0)
    where = {
        "Parameter": "params", "Sharded Param": "params", "Unsharded Param": "params",
        "Gradient": "grads", "Sharded Grad": "grads", "Unsharded Grad": "grads",
        "Optstate": "optimizer", "OptState": "optimizer",
        "Activation": "activations", "Temp": "activations", "Inputs": "activations",
        "All Gather": "comm", "Reduce Scatter": "comm",
        "Buffer": "buffers", "Other": "buffers",
    }  # fmt: skip
    for kind, n in snapshot.items():
        name = getattr(kind, "value", kind)
        if name == "Total":
            continue
        out[where[name]] += int(n)
    return out


def table(layout: Layout, plans: list[RankPlan]) -> str:
    head = ["rank", "pp", *KINDS, "peak"]
    rows = [[str(p.rank), str(p.pp), *(f"{getattr(p, k) / MIB:.1f}" for k in (*KINDS, "peak"))] for p in plans]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"memory plan, {layout.describe()} ({layout.kind}), MiB per rank at a training step's peak"]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a config file or example name, as hpc.submit takes it")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key by dotted path, as hpc.submit takes it (repeatable)")  # fmt: skip
    p.add_argument("--nodes", type=int, help="plan for this many nodes (default: job.nodes)")
    p.add_argument("--ranks-per-node", type=int, help="plan for this many ranks a node (default: job.ranks_per_node)")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--coordinate", type=int, help=argparse.SUPPRESS)  # one pipeline coordinate's rank (internal)
    args = p.parse_args(argv)
    sets = [*args.overrides]
    if args.nodes:
        sets.append(f"job.nodes={args.nodes}")
    if args.ranks_per_node:
        sets.append(f"job.ranks_per_node={args.ranks_per_node}")
    try:
        cfg = load_config(args.config, sets)
        layout = layout_for(cfg, cfg.job.world_size)
        if layout.pp > 1 and args.coordinate is None:
            return _by_coordinate(args, layout, sys.argv[1:] if argv is None else argv)
        layout, one = plan(cfg, cfg.job.world_size, args.coordinate or 0)
        plans = [one]
    except (UserError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = {"layout": layout.describe(), "world_size": cfg.job.world_size, "ranks": [asdict(x) for x in plans]}
    print(json.dumps(out) if args.json else table(layout, plans) + "\n" + json.dumps(out))
    return 0


def _by_coordinate(args: argparse.Namespace, layout: Layout, argv: list[str]) -> int:
    """Each pipeline coordinate's rank planned in a process of its own, as in the job: DTensor's caches would
    carry one fake world's meshes (equal to the next one's, naming other groups) into the next rank's plan."""
    ranks = []
    for c in range(layout.pp):
        done = subprocess.run([sys.executable, "-m", "trainer.plan", *argv, "--json", "--coordinate", str(c)],
                              capture_output=True, text=True)  # fmt: skip
        sys.stderr.write(done.stderr)  # its warnings, or why it failed
        if done.returncode != 0:
            return done.returncode if done.returncode > 0 else 1
        ranks += json.loads(done.stdout.strip().splitlines()[-1])["ranks"]  # the last line: what a recipe printed
        # before it is not the plan
    out = {"layout": layout.describe(), "world_size": layout.world_size, "ranks": ranks}
    print(json.dumps(out) if args.json else table(layout, [RankPlan(**r) for r in ranks]) + "\n" + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
