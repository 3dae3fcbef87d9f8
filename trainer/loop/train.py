"""The training loop: data-parallel steps with gradient accumulation, clipping, eval and metrics."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from runconfig.schema import RunConfig
from trainer.data.dataset import DataState, GlobalOrder, TokenShards, rank_slice
from trainer.env import RuntimeEnv
from trainer.errors import UserError
from trainer.loop.optim import build_optimizer, lr_at
from trainer.loop.stop import StopFlag
from trainer.models.gpt import GPT, loss_fn
from trainer.observe.metrics import MetricsWriter
from trainer.observe.monitors import Monitors
from trainer.observe.timing import peak_memory_mb
from trainer.parallel.comm import hierarchical_hook
from trainer.parallel.distributed import Distributed

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Everything that advances with the steps (what a checkpoint must hold besides model and optimizer)."""

    step: int = 0
    tokens_seen: int = 0
    data: DataState = field(default_factory=DataState)
    last_loss: float | None = None
    last_eval_loss: float | None = None
    elapsed_s: float = 0.0  # wall time spent in training over all runs of this run directory


@dataclass
class Components:
    model: GPT  # the bare module (parameter names without DDP's "module.")
    ddp: DDP
    optimizer: torch.optim.Optimizer


def build(cfg: RunConfig, env: RuntimeEnv, d: Distributed) -> Components:
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
    model = GPT(cfg.model).to(d.device)
    ddp = DDP(
        model,
        device_ids=[d.device.index] if d.device.type == "cuda" else None,
        bucket_cap_mb=cfg.comm.bucket_mb,
    )
    topo = env.topology
    if cfg.comm.allreduce == "hierarchical" and topo.num_nodes > 1 and topo.ranks_per_node > 1:
        ddp.register_comm_hook(d.groups, hierarchical_hook)
    elif cfg.comm.allreduce == "hierarchical" and env.rank == 0 and env.world_size > 1:
        # One node (or one rank per node): the hierarchy has a single level, and DDP's own all-reduce, which
        # overlaps with the backward pass, is strictly better than the synchronous three-phase hook.
        log.info("hierarchical all-reduce needs >1 node and >1 rank per node; using DDP's flat all-reduce")
    _settle_buckets(ddp, cfg, d.device)
    # Per-rank dropout stream, distinct across ranks and reproducible for a fixed seed and rank.
    torch.manual_seed(cfg.train.seed * 1_000_003 + 1 + env.rank)
    return Components(model=model, ddp=ddp, optimizer=build_optimizer(model, cfg.train))


def _settle_buckets(ddp: DDP, cfg: RunConfig, device: torch.device) -> None:
    """One throw-away forward/backward so DDP rebuilds its gradient buckets (in gradient-ready order) before the
    first real step, in every run. Without it the first step after a restart reduces in the initial bucket
    layout while the uninterrupted run used the rebuilt one, and flat all-reduce sums in another order: resume
    would not be bit-exact. Gradients are discarded; the optimizer does not step."""
    dummy = torch.zeros(cfg.train.micro_batch_size, cfg.model.seq_len + 1, dtype=torch.long, device=device)
    with _autocast(cfg, device):
        logits = ddp(dummy[:, :-1])
    loss_fn(logits, dummy[:, 1:]).backward()
    ddp.zero_grad(set_to_none=True)


def _autocast(cfg: RunConfig, device: torch.device):
    use_bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def evaluate(cfg: RunConfig, env: RuntimeEnv, d: Distributed, model: GPT, val: TokenShards) -> float:
    """Mean token loss over a fixed, evenly spaced set of held-out windows, split over the ranks."""
    ids = np.unique(np.linspace(0, len(val) - 1, cfg.train.eval_sequences).astype(np.int64))
    mine = ids[env.rank :: env.world_size]
    totals = torch.zeros(2, dtype=torch.float64, device=d.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(mine), cfg.train.micro_batch_size):
            batch = torch.from_numpy(val.batch(mine[start : start + cfg.train.micro_batch_size])).to(d.device)
            with _autocast(cfg, d.device):
                logits = model(batch[:, :-1])
            totals[0] += loss_fn(logits, batch[:, 1:], reduction="sum").double()
            totals[1] += batch[:, 1:].numel()
    model.train(was_training)
    dist.all_reduce(totals)
    return float(totals[0] / totals[1])


class Checkpoints(Protocol):
    def due_by_steps(self, step: int, final: bool) -> bool: ...
    def due_by_time(self) -> bool: ...
    def save(self, state: TrainState, *, block: bool) -> None: ...


def train(
    cfg: RunConfig,
    env: RuntimeEnv,
    d: Distributed,
    comps: Components,
    train_data: TokenShards,
    val_data: TokenShards,
    state: TrainState,
    metrics: MetricsWriter,
    checkpoints: Checkpoints,
    stop: StopFlag,
    mon: Monitors,
) -> bool:
    """Run optimizer steps from ``state.step`` to ``cfg.train.steps``; True if a stop signal ended it early.

    At every step boundary one small all-reduce shares the loss, any rank's stop request and rank 0's
    time-based checkpoint trigger, so all ranks take the same decision at the same step.
    """
    t = cfg.train
    world = env.world_size
    if t.global_batch_size % (t.micro_batch_size * world):
        raise UserError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
            f"{t.micro_batch_size} x {world} ranks (this run's world size).",
            collective=True,
        )
    accum = t.global_batch_size // (t.micro_batch_size * world)
    order = GlobalOrder(len(train_data), cfg.data.seed)
    tokens_per_step = t.global_batch_size * cfg.model.seq_len
    params = [p for p in comps.model.parameters() if p.requires_grad]
    ddp, opt = comps.ddp, comps.optimizer
    clock, watch = mon.clock, mon.watchdog
    ddp.train()
    loss_acc = torch.zeros((), device=d.device)
    interval_eval = 0.0
    boundary = time.perf_counter()  # the end of the last record's interval
    last_line = time.monotonic()
    run_start, elapsed_before, first_step = time.time(), state.elapsed_s, state.step
    log.info(
        "training steps %d..%d: world %d (%d nodes x %d), grad accumulation %d, %s all-reduce, device %s",
        state.step,
        t.steps,
        world,
        env.topology.num_nodes,
        env.topology.ranks_per_node,
        accum,
        cfg.comm.allreduce,
        d.device,
    )
    while state.step < t.steps:
        step = state.step + 1
        lr = lr_at(state.step, t)
        for group in opt.param_groups:
            group["lr"] = lr
        for micro in range(accum):
            watch.enter("data", step)
            with clock.part("data"):
                ids = rank_slice(
                    order,
                    state.data.position,
                    global_batch=t.global_batch_size,
                    micro_batch=t.micro_batch_size,
                    world_size=world,
                    rank=env.rank,
                    micro=micro,
                )
                batch = torch.from_numpy(train_data.batch(ids)).to(d.device, non_blocking=True)
            last = micro == accum - 1
            watch.enter("forward/backward", step)
            with clock.backward(synchronizing=last and world > 1):
                mon.injector.in_compute(step)
                with contextlib.nullcontext() if last else ddp.no_sync():
                    with _autocast(cfg, d.device):
                        logits = ddp(batch[:, :-1])
                    loss = loss_fn(logits, batch[:, 1:]) / accum
                    loss.backward()
            loss_acc += loss.detach()
        watch.enter("optimizer", step)
        with clock.part("optim"):
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip > 0 else float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
        state.step = step
        state.data.position += t.global_batch_size
        state.tokens_seen += tokens_per_step

        is_last = state.step == t.steps
        watch.enter("metric all-reduce", step)
        with clock.part("sync"):
            shared = torch.zeros(3, dtype=torch.float64, device=d.device)
            shared[0] = loss_acc
            shared[1] = float(stop.requested)
            shared[2] = float(env.rank == 0 and checkpoints.due_by_time())
            dist.all_reduce(shared)
            step_loss, stop_now, due_by_time = shared.tolist()
        loss_acc.zero_()
        state.last_loss = step_loss / world
        state.elapsed_s = elapsed_before + time.time() - run_start
        # Straggler check on this step's busy time (before end_step: its all-gather is sync time of this step).
        mon.stragglers.add(clock.busy_so_far())
        extra = None
        if mon.stragglers.due(step):
            watch.enter("straggler all-gather", step)
            with clock.part("sync"):
                extra = mon.stragglers.check(step)
        eval_s = 0.0
        if t.eval_every and (state.step % t.eval_every == 0 or is_last):
            watch.enter("eval", step)
            eval_start = time.perf_counter()
            state.last_eval_loss = evaluate(cfg, env, d, comps.model, val_data)
            eval_s = time.perf_counter() - eval_start  # not step time; reported apart
            interval_eval += eval_s
        clock.end_step()

        # The record is written before this step's checkpoint: a kill between a commit and its record would
        # otherwise lose the record for good (the resumed run starts after it). A checkpoint's blocking time
        # is therefore counted in the next record (wall and time_ckpt_s); the last one of a launch (at a stop or
        # at the end) in no record: it is teardown.
        if state.step % t.log_every == 0 or is_last or eval_s or extra:
            now_pc = time.perf_counter()
            parts, steps = clock.take()
            step_time = (now_pc - boundary - interval_eval) / steps
            boundary = now_pc
            record = {
                "step": state.step,
                "loss": state.last_loss,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": tokens_per_step / step_time,
                "samples_per_s": t.global_batch_size / step_time,
                "step_time_s": step_time,
                **{f"time_{name}_s": seconds / steps for name, seconds in parts.items()},
                "time_eval_s": interval_eval,
                "tokens_seen": state.tokens_seen,
                "peak_mem_mb": peak_memory_mb(d.device),
                "time": time.time(),
                "launch": env.launch_id,
            }
            if eval_s:
                record["eval_loss"] = state.last_eval_loss
            if mon.peak_flops:
                record["mfu"] = tokens_per_step / step_time / world * mon.flops_per_token / mon.peak_flops
            if extra:
                record.update(extra)
            interval_eval = 0.0
            # Publishing the record (file, TensorBoard, log line) is timed as sync; like this step's checkpoint,
            # it falls in the next record's interval.
            with clock.part("sync"):
                metrics.write(record)
                mon.tensorboard.write(record)
                if mon.progress is not None:
                    mon.progress.update(record)
                now = time.monotonic()
                if env.rank == 0 and (eval_s or is_last or now - last_line >= cfg.monitor.log_every_s):
                    last_line = now
                    done_steps = state.step - first_step
                    eta = (t.steps - state.step) * (time.time() - run_start) / max(1, done_steps)
                    log.info(
                        "step %d/%d loss %s eval %s lr %.2e %.0f tok/s %.3f s/step ETA %s",
                        state.step,
                        t.steps,
                        _fmt(record.get("loss")),
                        _fmt(record.get("eval_loss")),
                        lr,
                        record["tokens_per_s"],
                        step_time,
                        _hms(eta),
                        extra={"progress": True},
                    )
        if stop_now or due_by_time or checkpoints.due_by_steps(state.step, is_last):
            watch.enter("checkpoint", step)
            with clock.part("ckpt"):
                checkpoints.save(state, block=bool(stop_now) or is_last)
        if stop_now and not is_last:
            log.info("stop requested (signal); stopped at step %d with a committed checkpoint", state.step)
            return True
    return False


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
