"""Building the training parts from a config, once per launch: the recipe (the user's model, data and loss), the
wrapped model and its all-reduce, the batch loader, the optimizer and schedule, the monitors and the checkpointer.
Start-up checks that can run before training do: the recipe's result, dataset lengths, items of one structure, and
one throw-away forward/backward whose loss must be a finite scalar (it also settles DDP's buckets).
Used by ``trainer.main`` and by the benchmarks."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch.utils.data import default_collate

from runconfig import RunConfig
from rundir import RunDir
from rundir.allreduce_plan import choose, plan_table
from storage.files import write_json_atomic
from storage.objstore import Store
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.rng import seed_rank
from trainer.checkpoint.state import TrainState
from trainer.data.loader import BatchLoader, fetch, to_device
from trainer.data.order import chosen_order
from trainer.data.resolve import open_splits
from trainer.env import RuntimeEnv, agree, patient_barrier
from trainer.errors import UserError, first_line
from trainer.loop.optim import build_optimizer, lr_at
from trainer.loop.parts import Parts, autocast
from trainer.loop.spikes import apply_skips
from trainer.loop.stop import StopFlag
from trainer.observe.live import open_live
from trainer.observe.metrics import MetricsWriter
from trainer.observe.monitors import build_monitors
from trainer.observe.replicas import ReplicaCheck
from trainer.observe.startup import StartupClock
from trainer.observe.termwatch import TermWatch
from trainer.observe.timing import peak_memory_mb, peak_tflops
from trainer.observe.tracker_sink import Tracker
from trainer.parallel.autotune import bucket_sizes, measure, mismatches, setup_of
from trainer.parallel.comm import check_overlapped
from trainer.parallel.distributed import Distributed
from trainer.parallel.grad_buckets import ddp_bucket_bytes
from trainer.parallel.materialise import buffers_to, owners, params_on_meta
from trainer.parallel.materialise import materialise as fill
from trainer.parallel.wrap import Wrapped, hook_up, wrap
from trainer.recipes.api import Recipe, RecipeContext
from trainer.recipes.load import build_recipe, check_lengths

log = logging.getLogger(__name__)
STRUCTURE_SAMPLES = 8  # items compared for one structure at start-up (default collate only)


def make_recipe(
    cfg: RunConfig,
    env: RuntimeEnv,
    distributed: Distributed,
    rundir: RunDir,
    comm: MPI.Comm,
    stack: contextlib.ExitStack,
) -> Recipe:
    """Seed torch with train.seed (same initial weights on every rank) and build the recipe. Collective: every rank
    gets the recipe or the same UserError (the first failing rank's)."""

    def token_data(seq_len: int, vocab_size: int | None):
        train, val = open_splits(cfg.data, seq_len, vocab_size, env, comm, Store(cfg.storage))
        stack.callback(train.close)
        stack.callback(val.close)
        if train.cache is not None:
            stack.callback(train.cache.close)
        return train, val

    ctx = RecipeContext(
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        seed=cfg.train.seed,
        device=distributed.device,
        micro_batch_size=cfg.train.micro_batch_size,
        config=cfg,
        run_dir=rundir.root,
        cache_dir=env.data_cache,
        _barrier=functools.partial(patient_barrier, comm),  # the others wait without spinning on rank 0's cores
        _token_data=token_data,
    )
    torch.manual_seed(cfg.train.seed)
    recipe, error = None, None
    try:
        with params_on_meta() if cfg.parallel.meta_init else contextlib.nullcontext():
            recipe = build_recipe(cfg.recipe, dict(cfg.recipe_args), ctx)
        check_lengths(cfg.recipe, recipe, global_batch=cfg.train.global_batch_size)
    except UserError as exc:
        error = str(exc)
    agree(comm, error)
    return recipe


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
) -> Parts:
    """Everything ``trainer.loop.train`` drives; what needs closing is registered on ``stack``. ``clock`` notes
    when the recipe was built and this rank's peak memory once the model is built and split (``model_built``),
    before any forward. ``tracker``: rank 0's (``trainer.boot`` opens it, so that its sender's start-up overlaps
    the launch's)."""
    recipe = make_recipe(cfg, env, distributed, rundir, comm, stack)
    if clock is not None:
        clock.mark("recipe")
    wrapped, shapes = place_model(cfg, env, distributed, recipe, comm)
    if clock is not None:
        clock.note_memory("model_built", peak_memory_mb(distributed.device))
    model = wrapped.model  # this rank's part under pipeline parallelism
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
    if wrapped.pipe is not None:
        wrapped.pipe.accum = loader.accum
    agree(comm, _error_of(lambda: check_structure(cfg.recipe, recipe)) if env.rank == 0 else None)
    settle(cfg, env, wrapped, recipe, loader, comm)
    # Counted before the per-rank reseed below: a counting pass draws dropout randoms too. A pipeline stage cannot
    # count the whole model's: only the recipe's own figure is used there.
    flops = None
    if peak_tflops(distributed.device, cfg.monitor.peak_tflops) and (wrapped.pipe is None or recipe.flops_per_sample):
        flops = count_flops_per_sample(cfg, recipe, distributed)
    # Per-rank random streams (dropout, augmentation), distinct across ranks and reproducible for a fixed seed.
    seed_rank(t.seed, env.rank)
    optimizer = recipe.optimizer(model) if recipe.optimizer else build_optimizer(model, t)
    mon = build_monitors(cfg, env, distributed, model, rundir, flops, ddp=not wrapped.layout.uses_mesh, tracker=tracker)
    stack.callback(mon.close)
    term = TermWatch(stop, mon.watchdog, env, rundir)  # SIGTERM while the main thread is blocked in C++
    term.start()
    stack.callback(term.close)
    mon.replicas = ReplicaCheck(cfg.monitor.replica_check_every, wrapped.layout, env)
    mon.live = open_live(cfg.live, env, rundir, mon.watchdog.reader() if mon.watchdog.enabled else None, comm)
    checkpoints = Checkpointer(
        cfg=cfg,
        env=env,
        rundir=rundir,
        model=model,
        optimizer=optimizer,
        comm=comm,
        architecture=dict(recipe.architecture),
        param_shapes=shapes,
        aliases=wrapped.aliases,
        code_sha256=code_sha256,
        injector=mon.injector,
    )
    stack.callback(checkpoints.close)
    if tracker is not None:  # a step's metrics go to the tracker once a committed checkpoint covers it
        checkpoints.on_commit = tracker.committed
        checkpoints.tracking_run = lambda: tracker.run_id
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
        lr_schedule=recipe.lr_schedule or functools.partial(lr_at, cfg=t),
        loader=loader,
        state=TrainState(),
        checkpoints=checkpoints,
        metrics=metrics,
        stop=stop,
        mon=mon,
    )


def place_model(
    cfg: RunConfig, env: RuntimeEnv, distributed: Distributed, recipe: Recipe, comm: MPI.Comm
) -> tuple[Wrapped, dict[str, list]]:
    """The recipe's model on the device, split for the layout (``wrap``); with parallel.meta_init each rank
    allocates and fills only its part after the split. Also the whole model's {name: [*shape, dtype]}."""
    materialise, init_error = None, []
    if cfg.parallel.meta_init:  # parameters on meta: split first, then allocate and fill this rank's part only
        model = recipe.model
        buffers_to(model, distributed.device)
        plan = owners(model)
        seed, spec = cfg.train.seed, cfg.recipe

        def materialise(part: torch.nn.Module) -> None:
            error = fill(part, plan, recipe.init_weights, seed=seed, device=distributed.device, spec=spec)
            init_error.append(error)
    else:
        model = recipe.model.to(distributed.device)
    shapes = {n: [*q.shape, str(q.dtype)] for n, q in model.named_parameters()}  # the whole model's
    wrapped = wrap(cfg, env, distributed, model, recipe, materialise=materialise)
    if cfg.parallel.meta_init:
        agree(comm, init_error[0] if init_error else None)
    return wrapped, shapes


def settle(
    cfg: RunConfig,
    env: RuntimeEnv,
    wrapped: Wrapped,
    recipe: Recipe,
    loader: BatchLoader,
    comm: MPI.Comm,
) -> None:
    """One throw-away forward/backward on this rank's first micro-batch, so DDP rebuilds its gradient buckets (in
    gradient-ready order) before the first real step in every run: without it the first step after a restart
    reduces in the initial bucket layout while the uninterrupted run used the rebuilt one, and resume would not
    be bit-exact. It doubles as the check that the loss is a finite scalar (under pipeline parallelism: on the
    last stage, through the schedule). Where DDP runs (or, for auto, may run) the trainer's hook, a second pass
    rebuilds the buckets, whose sizes are then noted. Gradients are discarded."""
    pipe, tp = wrapped.pipe, wrapped.layout.tp
    error, loss = None, None
    try:
        batch = loader.batch_at(0, 0)
        with autocast(cfg, loader.device):
            if pipe is None:
                loss = recipe.loss(wrapped.module, batch)
            else:
                try:
                    loss = pipe.step(batch)
                except UserError as exc:  # the recipe's Pipeline.loss, checked inside the schedule
                    raise UserError(f"rank {env.rank}: recipe {cfg.recipe!r}: {exc}") from None
        if pipe is None or pipe.last:
            check_first_loss(cfg.recipe, env.rank, loss)
    except UserError as exc:
        error = str(exc)
    except (RuntimeError, ValueError) as exc:
        if tp == 1:
            raise
        error = (
            f"rank {env.rank}: recipe {cfg.recipe!r}: the first forward under parallel.tp={tp} raised "
            f"{first_line(exc).rstrip('.')}. With tensor parallelism each rank holds 1/{tp} of the split layers, "
            "so the model's forward must take its sizes from the tensors (e.g. x.view(b, t, -1, head_dim), not "
            "n_heads), and the recipe's tp_plan must match how the layers connect."
        )
    if pipe is not None:
        if error is not None:  # the other stages may be inside the schedule, waiting for this one: end the job
            raise UserError(error)
        agree(comm, None)
    else:
        agree(comm, error)  # before backward: its all-reduce needs every rank
        throwaway_backward(wrapped, loss)
        if wrapped.dispatch is not None:
            # DDP rebuilds its buckets at the next forward (in gradient-ready order, at the configured caps; the
            # first backward ran its initial layout, whose first bucket is 1 MB whatever comm.bucket_mb says). One
            # more pass, so that the sizes noted below are the ones training reduces: the sizes auto's plan is
            # measured for and the overlapped reduction is checked on.
            with autocast(cfg, loader.device):
                loss = recipe.loss(wrapped.module, batch)
            throwaway_backward(wrapped, loss)
    (wrapped.carrier or wrapped.model).zero_grad(set_to_none=True)  # the carrier holds the model
    if wrapped.dispatch is not None:
        wrapped.dispatch.sizes = bucket_sizes(ddp_bucket_bytes(wrapped.module))


def throwaway_backward(wrapped: Wrapped, loss: torch.Tensor) -> None:
    """Backward of a throw-away pass as training runs it: with the carried agreement's term where there is one
    (DDP expects a gradient for every parameter it holds, and rebuilds its buckets in the order they came)."""
    if wrapped.carrier is None:
        loss.backward()
    else:
        wrapped.carrier.backward(loss)


def check_first_loss(spec: str, rank: int, loss: Any) -> None:
    """The loss of the first batch must be a finite floating-point scalar tensor."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)[:200]
        raise UserError(
            f"rank {rank}: recipe {spec!r}: the loss of the first batch is {what}; Recipe.loss must return a "
            "floating-point scalar tensor (the mean loss of the batch)."
        )
    if not torch.isfinite(loss.detach()):
        raise UserError(
            f"rank {rank}: recipe {spec!r}: the loss of the first batch is {float(loss)} before any training step "
            "(check the data and the loss function)."
        )


def _error_of(check) -> str | None:
    try:
        check()
    except UserError as exc:
        return str(exc)
    return None


def structure(x: Any) -> Any:
    """The shape of an item for comparison: types, tensor/array shapes and dtypes, nested."""
    if isinstance(x, torch.Tensor | np.ndarray):
        return f"{type(x).__name__}{list(x.shape)} {x.dtype}"
    if isinstance(x, dict):
        return {k: structure(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, list | tuple):
        return [structure(v) for v in x]
    return type(x).__name__


def check_structure(spec: str, recipe: Recipe) -> None:
    """Items of a dataset batched by the default collate must share one structure: compare a few, evenly spaced."""
    for name in ("train_data", "eval_data"):
        data = getattr(recipe, name)
        if data is None or recipe.collate not in (None, default_collate):
            continue
        spread = np.linspace(0, len(data) - 1, STRUCTURE_SAMPLES).astype(np.int64)
        ids = np.unique(np.concatenate([np.arange(min(4, len(data))), spread]))  # neighbours and far ones
        first = None
        for i in ids:
            try:
                item = structure(data[int(i)])
            except UserError:
                raise
            except Exception as exc:
                raise UserError(f"recipe {spec!r}: {name}[{int(i)}] raised {first_line(exc)}") from None
            if first is None:
                first = (int(i), item)
            elif item != first[1]:
                raise UserError(
                    f"recipe {spec!r}: {name} items differ in structure, shape or dtype: item {first[0]} is "
                    f"{first[1]}, item {int(i)} is {item}. Items batched by the default collate must match (or give "
                    "the recipe a collate function that pads)."
                )


def count_flops_per_sample(cfg: RunConfig, recipe: Recipe, distributed: Distributed) -> float:
    """The recipe's FLOPs per sample, else counted with FlopCounterMode on one forward/backward of one
    micro-batch of the bare model (the counted gradients are discarded)."""
    if recipe.flops_per_sample:
        return float(recipe.flops_per_sample)
    from torch.utils.flop_counter import FlopCounterMode

    ids = np.arange(min(cfg.train.micro_batch_size, len(recipe.train_data)))
    batch = to_device(
        fetch(recipe.train_data, ids, recipe.collate or default_collate, what="train_data", rank=0), distributed.device
    )
    counter = FlopCounterMode(display=False)
    with counter:
        recipe.loss(recipe.model, batch).backward()
    recipe.model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / len(ids)


def plan_allreduce(parts: Parts, rundir: RunDir) -> None:
    """comm.allreduce=auto (collective): give DDP's hook its plan. A resumed run reuses the plan its checkpoint
    recorded (the same algorithms, so the same reduction order: bit-exact), unless it was measured for another
    topology or comm settings; then comm.plan_from's; else it is measured now, for the bucket sizes the throw-away
    step saw, and written into the run directory."""
    dispatch = parts.wrapped.dispatch
    if dispatch is None or dispatch.algorithm is not None:
        return
    groups, plan, source = parts.distributed.groups, parts.state.allreduce_plan, parts.cfg.comm.plan_from
    wanted = setup_of(groups)
    how, measured = "recorded in the checkpoint, reused", "measured"
    if plan is not None and (changed := mismatches(plan, wanted)):
        measured = f"measured again: the checkpoint's plan was for {'; '.join(changed)}"
        plan = None
    if plan is None and source:
        plan, how = _plan_from(source, wanted), f"from {source}"
    if plan is None:
        plan = measure(groups, dispatch.sizes, parts.distributed.device, one_network=parts.env.one_network)
        how = measured + ("; one host, one network: flat chosen" if plan["one_network"] else "")
        if parts.env.rank == 0:
            write_json_atomic(rundir.allreduce_plan, plan)
    parts.state.allreduce_plan = plan
    dispatch.plan = functools.partial(choose, plan)
    if groups.compress or any(row["choice"] != "flat" for row in plan["sizes"]):
        hook_up(parts.cfg, parts.distributed, parts.wrapped.module, dispatch)
        runs = "the trainer's hook runs it"
    else:
        # Every bucket flat: DDP's own all-reduce runs, with no hook (the same bits as comm.allreduce=flat). A
        # Python hook issuing the same all-reduce is slower: each bucket's call and completion take the GIL, which
        # DDP's C++ path never does (docs/measurements/notes-trainer.md).
        parts.wrapped.dispatch = None
        runs = "every bucket flat: DDP's own all-reduce runs, no hook"
    if parts.env.rank == 0:
        log.info(
            "all-reduce plan (comm.allreduce=auto, %s; measured in %.2f s, %s; %s):\n%s",
            how,
            plan["measured_s"],
            plan["timing"],
            runs,
            "\n".join(plan_table(plan)),
        )


def check_overlap(parts: Parts) -> None:
    """comm.overlap (collective): before training, the overlapped reduction (the reducer's thread on CPU, a CUDA
    side stream on GPUs) must give the synchronous reduction's bits on every bucket size the hook will see; if it
    does not on some rank, training would go on with wrong gradients, so the run ends with the ranks named and
    the setting that avoids it. Not where DDP's own all-reduce runs (flat, or a plan that sends every bucket flat)."""
    dispatch = parts.wrapped.dispatch
    if dispatch is None or dispatch.overlapped is None:
        return
    sizes = dispatch.sizes
    start = time.perf_counter()
    bad = check_overlapped(dispatch, sizes, parts.distributed.device)
    where = "a CUDA side stream" if parts.distributed.device.type == "cuda" else "the reducer's thread"
    checked = ", ".join(f"{dispatch.choose(size)} {size / 1024:.1f} KiB" for size in sizes)
    if bad:
        raise UserError(
            f"comm.overlap: on rank(s) {', '.join(map(str, bad))} the gradient reduction overlapped with backward "
            f"(on {where}) gave other values than the same reduction run synchronously ({checked}): training with "
            "it would use wrong gradients. Set comm.overlap=false (each bucket is then reduced inside DDP's hook, "
            "blocking backward) and report this with the torch and NCCL versions.",
            collective=True,
        )
    if parts.env.rank == 0:
        log.info(
            "comm.overlap: the reduction on %s gave the synchronous one's bits (%s; checked in %.3f s)",
            where,
            checked,
            time.perf_counter() - start,
        )


def _plan_from(source: str, wanted: dict) -> dict:
    path = Path(source)
    path = path / RunDir(path).allreduce_plan.name if path.is_dir() else path
    try:
        plan = json.loads(path.read_text())
        mismatch = mismatches(plan, wanted)
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise UserError(
            f"comm.plan_from: cannot read an all-reduce plan from {path} ({first_line(exc)}); name the run directory "
            "of a run with comm.allreduce=auto (its allreduce_plan.json), or unset comm.plan_from to measure."
        ) from None
    if mismatch:
        raise UserError(
            f"comm.plan_from: the plan in {path} was measured for another set-up: {'; '.join(mismatch)}. Unset "
            "comm.plan_from to measure one for this run."
        )
    return plan


def bucketing(cfg: RunConfig) -> tuple[int, int]:
    """(micro-batch, window in samples) of data.bucket_by_length, or (0, 0)."""
    if not cfg.data.bucket_by_length:
        return 0, 0
    return cfg.train.micro_batch_size, cfg.data.bucket_window * cfg.train.global_batch_size


def restore_or_start(parts: Parts, rundir: RunDir) -> bool:
    """Resume from the newest valid checkpoint when there is one (and checkpoint.resume); True if resumed."""
    resumed = bool(parts.cfg.checkpoint.resume) and parts.checkpoints.restore(parts.state)
    # a loss spike rolled back to before it: its data is skipped (trainer/loop/spikes.py), whatever train.spike_*
    # says now
    position, applied = apply_skips(rundir, parts.state.step, parts.state.data_position)
    if applied:
        log.info("restored step %d: skipping the data of a loss spike (positions %d..%d of the data order)",
                 parts.state.step, parts.state.data_position, position)  # fmt: skip
        parts.state.data_position = position
    data = parts.cfg.data
    spec = chosen_order(data.order, data.shuffle_window, parts.state.data_order, resumed, *bucketing(parts.cfg))
    parts.state.data_order = spec.as_dict()
    parts.loader.use_order(spec)
    return resumed
