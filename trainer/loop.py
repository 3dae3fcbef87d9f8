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
from trainer.comm import hierarchical_hook
from trainer.data.dataset import DataState, GlobalOrder, TokenShards, rank_slice
from trainer.distributed import Distributed
from trainer.env import RuntimeEnv
from trainer.errors import UserError
from trainer.metrics import MetricsWriter
from trainer.model import GPT, loss_fn
from trainer.optim import build_optimizer, lr_at
from trainer.stop import StopFlag

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
    ddp.train()
    loss_acc = torch.zeros((), device=d.device)
    last_log_time, last_log_step = time.perf_counter(), state.step
    run_start, elapsed_before = time.time(), state.elapsed_s
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
        lr = lr_at(state.step, t)
        for group in opt.param_groups:
            group["lr"] = lr
        for micro in range(accum):
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
            sync = contextlib.nullcontext() if micro == accum - 1 else ddp.no_sync()
            with sync:
                with _autocast(cfg, d.device):
                    logits = ddp(batch[:, :-1])
                loss = loss_fn(logits, batch[:, 1:]) / accum
                loss.backward()
            loss_acc += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip > 0 else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        state.step += 1
        state.data.position += t.global_batch_size
        state.tokens_seen += tokens_per_step

        is_last = state.step == t.steps
        shared = torch.zeros(3, dtype=torch.float64, device=d.device)
        shared[0] = loss_acc
        shared[1] = float(stop.requested)
        shared[2] = float(env.rank == 0 and checkpoints.due_by_time())
        dist.all_reduce(shared)
        step_loss, stop_now, due_by_time = shared.tolist()
        loss_acc.zero_()
        state.last_loss = step_loss / world
        state.elapsed_s = elapsed_before + time.time() - run_start
        record = None
        if state.step % t.log_every == 0 or is_last:
            now = time.perf_counter()
            step_time = (now - last_log_time) / (state.step - last_log_step)
            last_log_time, last_log_step = now, state.step
            record = {
                "step": state.step,
                "loss": state.last_loss,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": tokens_per_step / step_time,
                "step_time_s": step_time,
                "tokens_seen": state.tokens_seen,
                "time": time.time(),
            }
        if t.eval_every and (state.step % t.eval_every == 0 or is_last):
            eval_start = time.perf_counter()
            state.last_eval_loss = evaluate(cfg, env, d, comps.model, val_data)
            record = record or {"step": state.step, "time": time.time()}
            record["eval_loss"] = state.last_eval_loss
            last_log_time += time.perf_counter() - eval_start  # eval time is not step time
        if record is not None:
            metrics.write(record)
            if env.rank == 0 and ("eval_loss" in record or state.step % max(1, t.steps // 20) == 0 or is_last):
                log.info(
                    "step %d/%d loss %s eval %s lr %.2e %.0f tok/s",
                    state.step,
                    t.steps,
                    _fmt(record.get("loss")),
                    _fmt(record.get("eval_loss")),
                    lr,
                    record.get("tokens_per_s", float("nan")),
                )
        if stop_now or due_by_time or checkpoints.due_by_steps(state.step, is_last):
            ckpt_start = time.perf_counter()
            checkpoints.save(state, block=bool(stop_now) or is_last)
            last_log_time += time.perf_counter() - ckpt_start  # reported apart from step time
        if stop_now and not is_last:
            log.info("stop requested (signal); stopped at step %d with a committed checkpoint", state.step)
            return True
    return False


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
