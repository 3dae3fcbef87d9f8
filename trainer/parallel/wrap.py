"""The model as the loss calls it, for the run's parallel layout: DDP (with the hierarchical all-reduce where
there are two levels), or the DeviceMesh path: tensor parallelism with the recipe's plan, then FSDP2 sharding
(HSDP on a 2-D mesh) over the data-parallel ranks, with activation checkpointing on the recipe's blocks for
any of them. One place decides; the loop only sees ``Wrapped``."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from runconfig import RunConfig
from runconfig.layout import Layout, LayoutError
from trainer.env import RuntimeEnv
from trainer.errors import UserError
from trainer.parallel.carrier import Carrier
from trainer.parallel.comm import BucketDispatch, BucketReducer, SideStream, overlapped_hook, stream_hook, sync_hook
from trainer.parallel.cp import SequenceSplit, check_recipe
from trainer.parallel.diloco import OuterSync
from trainer.parallel.distributed import Distributed
from trainer.parallel.float8 import to_float8
from trainer.parallel.fsdp import checkpoint_blocks, find_blocks, shard
from trainer.parallel.grad_buckets import ddp_bucket_caps
from trainer.parallel.mesh import dp_mesh, train_mesh
from trainer.parallel.pipeline import Pipe, cut, refresh, schedule
from trainer.parallel.tp import tensor_parallel
from trainer.recipes.api import Recipe

log = logging.getLogger(__name__)


@dataclass
class Wrapped:
    module: nn.Module  # what the loss calls: the DDP wrapper, or the (sharded) model itself
    layout: Layout
    # The gradient reduction that runs: comm.allreduce's choice ("auto", "hierarchical", "leader", "two_level"; "flat"
    # where DDP's own all-reduce runs), "fsdp", "hsdp", "replicate" (FSDP2's
    # all-reduce over whole replicas of a tensor-parallel model) or "tp" (none but tensor parallelism's own).
    allreduce: str
    no_sync: Callable[[], AbstractContextManager]  # around the micro-batches that only accumulate gradients
    model: nn.Module  # the bare module this rank trains: the whole model, or its pipeline stage (names unchanged)
    n_params: int  # of the whole model
    pipe: Pipe | None = None  # pipeline parallelism: this rank's stage and schedule
    dispatch: BucketDispatch | None = None  # DDP's hook's choice of algorithm (comm.allreduce=auto: its plan)
    carrier: Carrier | None = None  # the step's agreement rides in DDP's gradient reduction (comm.carry_agreement)
    outer: OuterSync | None = None  # comm.sync=diloco or local_sgd: DDP inside the node, the nodes meet in rounds
    # around each forward and backward that computes the loss: torch's loss_parallel() under parallel.loss_parallel
    loss_context: Callable[[], AbstractContextManager] = contextlib.nullcontext
    cp: SequenceSplit | None = None  # parallel.cp: each micro-batch's sequences split over the cp group

    @property
    def aliases(self) -> dict[str, str]:
        """Names of tied copies the whole model lists once (a pipeline's head tied to another stage's embedding),
        each -> the name the whole model lists."""
        return self.pipe.aliases if self.pipe is not None else {}


def layout_of(cfg: RunConfig, env: RuntimeEnv) -> Layout:
    """The config's layout on this launch's world (which may be smaller than the job's after a node was left out)."""
    try:
        return cfg.layout(env.world_size)
    except LayoutError as exc:
        raise UserError(
            f"parallel.{exc.key}: {exc} (this launch has {env.world_size} ranks: {env.topology.num_nodes} nodes x "
            f"{env.topology.ranks_per_node})."
        ) from None


def wrap(
    cfg: RunConfig,
    env: RuntimeEnv,
    distributed: Distributed,
    model: nn.Module,
    recipe: Recipe,
    *,
    materialise: Callable[[nn.Module], None] | None = None,
) -> Wrapped:
    """``materialise``: for a model whose parameters are on the meta device (``parallel.meta_init``), allocates and
    fills this rank's part once it is split (before DDP, which broadcasts values, or a pipeline schedule)."""
    # DDP and FSDP read attributes of torch._dynamo, which trainer.main imports in a background thread to save
    # start-up time: an import statement waits for that import to finish, where an attribute read of the half-
    # initialised module can fail.
    importlib.import_module("torch._dynamo")

    layout = layout_of(cfg, env)
    check_recipe(layout, recipe, cfg.recipe)
    n_params = sum(p.numel() for p in model.parameters())
    split_output = output_layer(cfg, model, recipe)
    model, cut_info, blocks = stage_and_blocks(cfg, env, model, recipe, layout, distributed.device)
    mesh = train_mesh(layout, distributed.device)  # None for DDP
    if layout.tp > 1:  # first, as torchtitan: FSDP2 then shards the tensor-parallel DTensors over the dp mesh
        tensor_parallel(model, recipe.tp_plan, mesh["tp"], recipe=cfg.recipe, split_output=split_output)
    compile_blocks(model, blocks, cfg.parallel.compile)  # after TP, before FSDP2 (torchtitan's order)
    if mesh is None:
        if materialise is not None:
            materialise(model)
        if cfg.comm.sync != "ddp":
            return _rounds(cfg, env, distributed, model, layout, n_params)
        carrier = Carrier(model, distributed.device) if carries_agreement(cfg, distributed) else None
        ddp = DDP(
            carrier or model,
            device_ids=[distributed.device.index] if distributed.device.type == "cuda" else None,
            **ddp_bucket_caps(cfg.comm),
        )
        allreduce, dispatch = wire_allreduce(cfg, env, distributed, ddp)
        return Wrapped(ddp, layout, allreduce, ddp.no_sync, model, n_params, dispatch=dispatch, carrier=carrier)
    allreduce, no_sync = data_parallel_over_mesh(cfg, distributed, model, blocks, mesh, layout, stages_of(cut_info))
    if materialise is not None:
        materialise(model)
    pipe = None
    if cut_info is not None:
        pipe = schedule(
            model,
            layout,
            mesh,
            env.rank,
            distributed.device,
            recipe.pipeline,
            cut_info,
            kind=cfg.parallel.pp_schedule,
            microbatches=cfg.parallel.microbatches(layout.pp),
            ledger=distributed.ledger,
        )
    wrapped = Wrapped(model, layout, allreduce, no_sync, model, n_params, pipe)
    if layout.cp > 1:
        wrapped.cp = SequenceSplit(mesh["cp"], recipe.context_parallel, distributed.device)
    if split_output is not None:
        from torch.distributed.tensor.parallel import loss_parallel

        wrapped.loss_context = loss_parallel
    return wrapped


def output_layer(cfg: RunConfig, model: nn.Module, recipe: Recipe) -> str | None:
    """The module whose output stays split for the loss (``parallel.loss_parallel``), checked on the whole model;
    None when loss parallelism is off."""
    if not cfg.parallel.loss_parallel:
        return None
    path = recipe.output_layer
    if not path or path not in dict(model.named_modules()):
        given = "gives no Recipe.output_layer" if path is None else f"names output_layer={path!r}, not a module"
        raise UserError(
            f"parallel.loss_parallel: recipe {cfg.recipe!r} {given}. Loss parallelism keeps the output of the "
            "layer that makes the logits split by class: give the Recipe output_layer='<module path>' (the built-in "
            "GPT's is 'head'), or set parallel.loss_parallel: false."
        )
    if recipe.eval_metrics is not None:
        raise UserError(
            f"parallel.loss_parallel: recipe {cfg.recipe!r} has eval_metrics, which would get the logits split by "
            "class over the tensor-parallel group (a DTensor) instead of whole ones; drop the eval_metrics or set "
            "parallel.loss_parallel: false."
        )
    return path


def _rounds(
    cfg: RunConfig, env: RuntimeEnv, distributed: Distributed, model: nn.Module, layout: Layout, n_params: int
) -> Wrapped:
    """comm.sync=diloco or local_sgd: DDP over this node's ranks (its own gradient all-reduce, no hook, no carried
    agreement: that must reach every node), the nodes meeting every comm.sync_every steps (diloco.py)."""
    groups = distributed.groups
    ddp = DDP(
        model,
        device_ids=[distributed.device.index] if distributed.device.type == "cuda" else None,
        process_group=groups.intra,
        **ddp_bucket_caps(cfg.comm),
    )
    outer = OuterSync(cfg.comm, model, groups, env.local_rank)
    if env.rank == 0:
        log.info("comm.sync=%s: DDP inside each node, the %d nodes meet every %d steps", cfg.comm.sync,
                 env.topology.num_nodes, cfg.comm.sync_every)  # fmt: skip
    return Wrapped(ddp, layout, cfg.comm.sync, ddp.no_sync, model, n_params, outer=outer)


def stage_and_blocks(
    cfg: RunConfig, env: RuntimeEnv, model: nn.Module, recipe: Recipe, layout: Layout, device: torch.device
):
    """This rank's pipeline stage (the whole model without pipeline parallelism) with float8 layers where the run
    asks for them, its blocks, and their activation checkpointing: (model, the stage's cut or None, blocks)."""
    cut_info = None
    if layout.pp > 1:  # first: everything else applies to this rank's stage
        p = cfg.parallel
        model, cut_info = cut(model, recipe.pipeline, layout, env.rank, spec=cfg.recipe, kind=p.pp_schedule,
                              per_rank=p.pp_stages_per_rank)  # fmt: skip
        if cut_info["shared"] and (layout.dp > 1 or layout.cp > 1):
            raise UserError(
                f"parallel.pp_stages_per_rank={p.pp_stages_per_rank}: recipe {cfg.recipe!r}'s stages on rank "
                f"{env.rank} both run module(s) {', '.join(cut_info['shared'][:4])} with parameters of their own; "
                "beside data parallelism each stage is an FSDP2 root of its own, and two roots cannot shard one "
                "parameter. Give each stage its own modules (a weight they share: through different modules, "
                "as a tied embedding and head), or set parallel.pp_stages_per_rank: 1."
            )
    if cfg.train.precision == "float8":  # before the blocks are found, as torchtitan: TP and FSDP2 then wrap them
        f8 = functools.partial(to_float8, device=device, emulate=cfg.train.float8_emulate, keep=recipe.output_layer,
                               spec=cfg.recipe, rank=env.rank)  # fmt: skip
        if cut_info is not None:  # each stage module the schedule runs, then the union of this rank's stages (whose
            # names the checkpoint keeps): a layer they share is swapped once, in its parent
            cut_info["modules"] = [f8(part, report=False) for part in cut_info["modules"]]
        model = f8(model)
    blocks = find_blocks(model, recipe.fsdp_wrap, recipe=cfg.recipe)
    mode = cfg.parallel.activation_checkpointing
    if mode != "none" and not blocks:
        raise UserError(
            f"parallel.activation_checkpointing={mode}: recipe {cfg.recipe!r}'s model has no blocks to recompute "
            "(no nn.ModuleList of layers); give the Recipe fsdp_wrap=[YourBlockClass], or set it to none."
        )
    checkpointed = checkpoint_blocks(blocks, mode)
    if env.rank == 0:
        log.info(
            "parallel layout: %s (%s)%s", layout.describe(), layout.kind,
            (f"; activation checkpointing: {checkpointed} of {len(blocks)} blocks ({mode})" if checkpointed else "")
            + (f"; torch.compile: {len(blocks) or 'the whole model, no'} blocks" if cfg.parallel.compile else "")
            + ("; FSDP2's shards in host memory (offload)" if cfg.parallel.offload else "")
            + (f"; loss parallelism: {recipe.output_layer}'s output split by class" if cfg.parallel.loss_parallel
               else ""),
        )  # fmt: skip
    return model, cut_info, blocks


def stages_of(cut_info: dict | None) -> list[nn.Module] | None:
    """The stage modules a rank runs where it runs several (parallel.pp_stages_per_rank), else None."""
    return cut_info["modules"] if cut_info is not None and len(cut_info["modules"]) > 1 else None


def data_parallel_over_mesh(
    cfg: RunConfig,
    distributed: Distributed,
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    layout: Layout,
    stages: list[nn.Module] | None = None,
) -> tuple[str, Callable[[], AbstractContextManager]]:
    """The mesh layouts' gradient reduction: (what summary.json calls it, the no-sync context of accumulation).
    ``stages``: a rank's several pipeline stages (``model`` merges them), each an FSDP2 root of its own with its
    blocks, as the schedule runs each apart (torchtitan's model parts); ``model`` then follows their new
    parameters."""
    # On CPU collectives block the training thread: their waits are its exposed communication (monitor.comm_by_dim)
    if distributed.device.type == "cpu" and cfg.monitor.comm_by_dim:
        # what is not timed apart: tensor parallelism's, the ring attention's and the replicas' collectives
        rest = [n for n in ("cp", "tp", "dp_replicate") if getattr(layout, n) > 1]
        distributed.ledger.enable("+".join(rest) or None)
    if layout.dp == 1 and layout.cp == 1:  # tensor (or pipeline) parallelism alone: no gradient reduction but theirs
        return ("tp" if layout.tp > 1 else "none"), contextlib.nullcontext
    # Data parallelism over DTensors (or pipeline stages) goes through FSDP2 even without sharding (dp_shard 1:
    # HSDP with a shard group of one, i.e. replicas all-reduced): DDP takes neither.
    roots = stages or [model]
    for root in roots:
        inside = {id(m) for m in root.modules()}
        shard(
            root,
            [b for b in blocks if id(b) in inside],
            dp_mesh(mesh, layout),
            # bf16 compute through FSDP2's mixed-precision policy wherever the run computes in bf16 (CPU included)
            param_dtype=torch.bfloat16 if cfg.train.bf16_on(distributed.device.type) else None,
            # Under a pipeline each block runs once per pipeline micro-batch: keep its parameters gathered
            # (torchtitan does the same).
            reshard_after_forward=cfg.parallel.fsdp_reshard_after_forward and layout.fsdp > 1 and layout.pp == 1,
            ledger=distributed.ledger,
            offload=cfg.parallel.offload,
        )
    if stages:
        refresh(model, stages)
    if layout.dp_replicate > 1:
        return ("hsdp" if layout.fsdp > 1 else "replicate"), functools.partial(_no_all_reduce, roots)
    # Plain FSDP reduce-scatters every micro-batch: keeping whole unsharded gradients between micro-batches would
    # cost the full model's gradient memory on every rank, which sharding avoids.
    return "fsdp", contextlib.nullcontext


def carries_agreement(cfg: RunConfig, distributed: Distributed) -> bool:
    """Whether a DDP layout carries the step's agreement in its gradient reduction (trainer/parallel/carrier.py):
    comm.carry_agreement over gloo, uncompressed. NCCL keeps the separate all-reduce, read a step later behind an
    event (reading the carried gradient at every boundary would wait for the device's whole queue); bf16 compression
    would round the carried loss to bf16."""
    return cfg.comm.carry_agreement and distributed.backend == "gloo" and cfg.comm.compress == "none"


def compile_blocks(model: nn.Module, blocks: list[nn.Module], on: bool) -> None:
    """``parallel.compile``: ``torch.compile`` each block's forward (activation checkpointing's included), or the
    whole model's where it has no blocks. The modules stay what they were (parameter names and the checkpoint's
    keys do not change), and the hooks of FSDP2 and DDP around a block's call stay outside the compiled graph.
    Compiled at the first call; blocks of one class share the compiled code. A block compiled before (a model kept
    by an in-process restart) keeps its compiled code."""
    if not on:
        return
    for block in blocks or [model]:
        if not getattr(block, "_hpc_compiled", False):
            block.forward = torch.compile(block.forward)
            block._hpc_compiled = True


@contextlib.contextmanager
def _no_all_reduce(roots: list[nn.Module]) -> Iterator[None]:
    """HSDP's accumulation micro-batches: reduce-scatter inside the shard group, all-reduce across replicas only
    with the step's last micro-batch (``roots``: the FSDP2 roots, a rank's pipeline stages where it runs several)."""
    for root in roots:
        root.set_requires_all_reduce(False)  # type: ignore[operator]
    try:
        yield
    finally:
        for root in roots:
            root.set_requires_all_reduce(True)  # type: ignore[operator]


def wire_allreduce(
    cfg: RunConfig, env: RuntimeEnv, distributed: Distributed, ddp: DDP
) -> tuple[str, BucketDispatch | None]:
    """Register the hook that runs the configured algorithm where there are two levels (for auto: later, once the
    plan is known, by ``hook_up``; none where it sends every bucket flat), torch's bf16 compression hook for a flat
    all-reduce across nodes with comm.compress; return the all-reduce that runs and the hook's dispatch (None where
    DDP's own all-reduce runs)."""
    topo, algorithm = env.topology, cfg.comm.allreduce
    if algorithm != "flat" and topo.num_nodes > 1 and topo.ranks_per_node > 1:
        dispatch = BucketDispatch(distributed.groups, None if algorithm == "auto" else algorithm)
        if algorithm != "auto":
            hook_up(cfg, distributed, ddp, dispatch)
        return algorithm, dispatch
    if cfg.comm.compress == "bf16" and topo.num_nodes > 1:  # the whole flat all-reduce crosses nodes in bf16
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        ddp.register_comm_hook(None, bf16_compress_hook)
    if algorithm not in ("flat", "auto") and env.rank == 0 and env.world_size > 1:
        # One node (or one rank per node): the hierarchy has a single level, and DDP's own all-reduce does the
        # same work in one collective instead of several.
        log.info("comm.allreduce=%s needs >1 node and >1 rank per node; using DDP's flat all-reduce", algorithm)
    return "flat", None


def hook_up(cfg: RunConfig, distributed: Distributed, ddp: DDP, dispatch: BucketDispatch) -> None:
    """Register DDP's communication hook that averages each bucket with ``dispatch`` (DDP takes one hook, once):
    inside the hook with comm.overlap off, else overlapped with backward (a CUDA side stream, or on CPU the
    reducer's thread)."""
    if not cfg.comm.overlap:
        ddp.register_comm_hook(dispatch, sync_hook)
    elif distributed.device.type == "cuda":
        side = SideStream(dispatch, distributed.device)
        dispatch.overlapped = side.reduce
        ddp.register_comm_hook(side, stream_hook)
    else:
        reducer = BucketReducer(dispatch)
        dispatch.overlapped = reducer.submit
        ddp.register_comm_hook(reducer, overlapped_hook)
