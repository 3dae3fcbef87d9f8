"""Start-up, the parts: the recipe and the model (their phases), then the loader, optimizer, monitors,
checkpointer and metrics the loop drives, each closed by the launch's ExitStack. The benchmarks build through it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging

import torch
from mpi4py import MPI

from runconfig import RunConfig
from rundir import RunDir
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.rng import seed_rank
from trainer.checkpoint.state import TrainState
from trainer.data.loader import BatchLoader
from trainer.data.order import bucketing, chosen_order
from trainer.env import RuntimeEnv, agree
from trainer.errors import error_of
from trainer.loop.optim import build_optimizer, lr_at
from trainer.loop.parts import Parts
from trainer.loop.stop import StopFlag
from trainer.observe.inject import Injector
from trainer.observe.live import open_live
from trainer.observe.metrics import MetricsWriter
from trainer.observe.monitors import Monitors, build_monitors
from trainer.observe.replicas import ReplicaCheck
from trainer.observe.startup import StartupClock
from trainer.observe.termwatch import TermWatch
from trainer.observe.timing import peak_memory_mb, peak_tflops, resident_mb
from trainer.observe.tracker_sink import Tracker
from trainer.parallel.distributed import Distributed
from trainer.parallel.wrap import Wrapped
from trainer.recipes.api import Recipe
from trainer.startup.model import place_model, settle
from trainer.startup.recipe import check_structure, make_recipe

log = logging.getLogger("trainer")


@dataclasses.dataclass
class Kept:
    """What an in-process restart (job.spare_ranks) keeps from one generation to the next in a surviving process:
    the recipe (its model and data), the optimizer over that model's parameters and the loader over that data, built
    once and closed by ``stack``, which outlives the generations. Their state (the optimizer's moments, the loader's
    position) is restored from the checkpoint as in a new process; only building them again is saved. The layout is
    the same in every generation (a spare takes a dead rank's place): the loader's rank and world size still hold."""

    stack: contextlib.ExitStack
    recipe: Recipe | None = None
    optimizer: torch.optim.Optimizer | None = None
    loader: BatchLoader | None = None
    runtime_mb: float | None = None  # Parts.runtime_mb, from the first generation

    def names(self) -> list[str]:
        return [n for n in ("recipe", "optimizer", "loader") if getattr(self, n) is not None]


def build_parts(
    cfg: RunConfig,
    env: RuntimeEnv,
    distributed: Distributed,
    rundir: RunDir,
    comm: MPI.Comm,
    stop: StopFlag,
    stack: contextlib.ExitStack,
    *,
    code_sha256: str | None = None,
    clock: StartupClock | None = None,
    tracker: Tracker | None = None,
    kept: Kept | None = None,
) -> Parts:
    """Everything ``trainer.loop.train`` drives; what needs closing is registered on ``stack``. ``clock`` notes
    when the recipe was built and this rank's peak memory once the model is built and split (``model_built``),
    before any forward. ``tracker``: rank 0's (``trainer.boot`` opens it, so that its sender's start-up overlaps
    the launch's). ``kept``: what an in-process restart keeps (what it lacks is built here, kept there for the next
    generation and closed by its stack); without, all is built here and closed by ``stack``."""
    kept = kept or Kept(stack)
    if kept.recipe is None:
        kept.recipe = make_recipe(cfg, env, distributed, rundir, comm, kept.stack)
        # after the background import that wrap() waits for (torch._dynamo: tens of MB, none of them the model's)
        importlib.import_module("torch._dynamo")
        kept.runtime_mb = resident_mb()
    recipe = kept.recipe
    if clock is not None:
        clock.mark("recipe")
    # MFU's FLOPs are counted on fake tensors of the whole model, before the split
    mfu = bool(peak_tflops(distributed.device, cfg.monitor.peak_tflops))
    wrapped, shapes, flops = place_model(cfg, env, distributed, recipe, comm, flops=mfu)
    if clock is not None:
        clock.note_memory("model_built", peak_memory_mb(distributed.device))
    model = wrapped.model  # this rank's part under pipeline parallelism
    if kept.loader is None:
        kept.loader = _loader(cfg, env, distributed, recipe, wrapped, kept.stack)
    loader = kept.loader
    if wrapped.pipe is not None:  # a pipeline takes its accumulation count from the loader
        wrapped.pipe.accum = loader.accum
    agree(comm, error_of(lambda: check_structure(cfg.recipe, recipe)) if env.rank == 0 else None)
    with wrapped.loss_context():  # the throw-away pass's forward and backward, as training runs them
        settle(cfg, env, wrapped, recipe, loader, comm)
    # Per-rank random streams (dropout, augmentation), distinct across ranks and reproducible for a fixed seed.
    seed_rank(cfg.train.seed, env.rank)
    if kept.optimizer is None:
        kept.optimizer = recipe.optimizer(model) if recipe.optimizer else build_optimizer(model, cfg.train)
    optimizer = kept.optimizer
    mon = _monitors(cfg, env, distributed, rundir, comm, stop, stack, wrapped=wrapped, flops=flops, tracker=tracker)
    checkpoints = _checkpointer(
        cfg, env, rundir, stack, recipe=recipe, wrapped=wrapped, optimizer=optimizer, shapes=shapes,
        code_sha256=code_sha256, injector=mon.injector, tracker=tracker,
    )  # fmt: skip
    metrics = MetricsWriter(rundir.metrics, enabled=env.rank == 0)
    stack.callback(metrics.close)
    return Parts(
        cfg=cfg,
        env=env,
        distributed=distributed,
        recipe=recipe,
        model=model,
        wrapped=wrapped,
        optimizer=optimizer,
        lr_schedule=recipe.lr_schedule or functools.partial(lr_at, cfg=cfg.train),
        loader=loader,
        state=TrainState(),
        checkpoints=checkpoints,
        metrics=metrics,
        stop=stop,
        mon=mon,
        runtime_mb=kept.runtime_mb,
    )


def _loader(
    cfg: RunConfig,
    env: RuntimeEnv,
    distributed: Distributed,
    recipe: Recipe,
    wrapped: Wrapped,
    stack: contextlib.ExitStack,
) -> BatchLoader:
    """The recipe's training data over the data-parallel ranks."""
    t = cfg.train
    loader = BatchLoader(
        recipe.train_data,
        collate=recipe.collate,
        seed=cfg.data.seed,
        order=chosen_order(cfg.data.order, cfg.data.shuffle_window, None, False, *bucketing(cfg)),
        global_batch=t.global_batch_size,
        micro_batch=t.micro_batch_size,
        world_size=wrapped.layout.dp,
        rank=wrapped.layout.dp_rank(env.rank),
        device=distributed.device,
        prefetch=cfg.data.prefetch,
        what=f"recipe {cfg.recipe!r}: train_data",
    )
    stack.callback(loader.close)
    return loader


def _monitors(
    cfg: RunConfig,
    env: RuntimeEnv,
    distributed: Distributed,
    rundir: RunDir,
    comm: MPI.Comm,
    stop: StopFlag,
    stack: contextlib.ExitStack,
    *,
    wrapped: Wrapped,
    flops: float | None,
    tracker: Tracker | None,
) -> Monitors:
    """The monitors and the watches beside them (SIGTERM, replica agreement, the live view), closed by ``stack``."""
    ddp = not wrapped.layout.uses_mesh
    mon = build_monitors(cfg, env, distributed, wrapped.model, rundir, flops, ddp=ddp, tracker=tracker)
    stack.callback(mon.close)
    term = TermWatch(stop, mon.watchdog, env, rundir)  # SIGTERM while the main thread is blocked in C++
    term.start()
    stack.callback(term.close)
    mon.replicas = ReplicaCheck(cfg.monitor.replica_check_every, wrapped.layout, env)
    mon.live = open_live(cfg.live, env, rundir, mon.watchdog.reader() if mon.watchdog.enabled else None, comm)
    return mon


def _checkpointer(
    cfg: RunConfig,
    env: RuntimeEnv,
    rundir: RunDir,
    stack: contextlib.ExitStack,
    *,
    recipe: Recipe,
    wrapped: Wrapped,
    optimizer: torch.optim.Optimizer,
    shapes: dict[str, list],
    code_sha256: str | None,
    injector: Injector,
    tracker: Tracker | None,
) -> Checkpointer:
    """The checkpointer of this rank's model and optimizer, closed by ``stack``; rank 0's tracker is told each
    committed step and named in each manifest."""
    checkpoints = Checkpointer(
        cfg=cfg,
        env=env,
        rundir=rundir,
        model=wrapped.model,
        optimizer=optimizer,
        architecture=dict(recipe.architecture),
        param_shapes=shapes,
        aliases=wrapped.aliases,
        code_sha256=code_sha256,
        injector=injector,
        outer=wrapped.outer,
    )
    stack.callback(checkpoints.close)
    if tracker is not None:  # a step's metrics go to the tracker once a committed checkpoint covers it
        checkpoints.on_commit = tracker.committed
        checkpoints.tracking_run = lambda: tracker.run_id
    return checkpoints
