"""Plain torch DDP on the trainer's model, config and prepared data: the baseline of bench/overhead.py.

Launched by torchrun (``torchrun --standalone --nproc-per-node 2 bench/plain_ddp.py --data DIR``). Builds
``trainer.models.gpt.GPT`` from the same config as the trainer (the tiny example plus ``--set`` overrides) and trains it
with the same batch, gradient accumulation, bucket size, AdamW settings and clipping; batches are random windows
of ``seq_len + 1`` tokens read from the HDF5 shards. Rank 0 prints one JSON object with the per-step times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runconfig import load_config  # noqa: E402
from trainer.loop.optim import adamw_impl  # noqa: E402
from trainer.models.gpt import GPT  # noqa: E402
from trainer.parallel.grad_buckets import ddp_bucket_caps  # noqa: E402


def lr_at(step: int, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help="config file or example name (default tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--data", type=Path, required=True, help="prepared dataset folder (manifest.json + shards)")
    p.add_argument("--json", type=Path, metavar="PATH", help="rank 0 also writes its JSON object to this file")
    p.add_argument("--progress", type=Path, help="rank 0 appends a line here after every step (a live step count)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, bf16 autocast as the trainer")
    p.add_argument(
        "--profile-steps",
        metavar="A-B",
        help="torch.profiler over steps A..B (1-based, as the trainer's monitor.profile_steps); rank 0 writes a "
        "Chrome trace to --profile-out, each step marked 'optimizer step N'",
    )
    p.add_argument("--profile-out", type=Path, help="the trace's file (with --profile-steps)")
    args = p.parse_args()
    args.first = args.last = 0
    if args.profile_steps:
        args.first, args.last = (int(x) for x in args.profile_steps.split("-"))
        if not args.profile_out:
            p.error("--profile-steps needs --profile-out")
    return args


def init(device_type: str) -> torch.device:
    """The process group (NCCL on CUDA, else gloo) and this rank's device."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    return device


def build(cfg, device: torch.device) -> tuple[GPT, DDP, torch.optim.Optimizer]:
    """The GPT, DDP around it with the trainer's bucket sizes, and AdamW as the trainer sets it up."""
    t = cfg.train
    torch.manual_seed(t.seed)
    model = GPT(cfg.model).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_bucket_caps(cfg.comm))
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        **adamw_impl(t.optimizer_impl),  # the trainer's kernels: the comparison is of everything around them
    )
    return model, ddp, opt


class Batches:
    """Random windows of ``seq_len + 1`` tokens from the train split's HDF5 shards, one micro-batch a call."""

    def __init__(self, data: Path, cfg, rank: int, device: torch.device) -> None:
        manifest = json.loads((data / "manifest.json").read_text())
        self.files = [h5py.File(data / s["file"], "r") for s in manifest["splits"]["train"]]
        self.shards = [f["tokens"] for f in self.files]
        self.rng = np.random.default_rng(cfg.train.seed * 1000 + rank)
        self.rows, self.window, self.device = cfg.train.micro_batch_size, cfg.model.seq_len + 1, device

    def __call__(self) -> torch.Tensor:
        rows = []
        for _ in range(self.rows):
            ds = self.shards[self.rng.integers(len(self.shards))]
            start = int(self.rng.integers(len(ds) - self.window))
            rows.append(ds[start : start + self.window])
        return torch.from_numpy(np.stack(rows).astype(np.int64)).to(self.device, non_blocking=True)

    def close(self) -> None:
        for f in self.files:
            f.close()


class Profile:
    """torch.profiler over steps ``first``..``last`` (1-based) on rank 0, each step marked; off when first is 0."""

    def __init__(self, args: argparse.Namespace, rank: int, cuda: bool) -> None:
        self.first, self.last, self.out = (args.first, args.last, args.profile_out) if rank == 0 else (0, 0, None)
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = None

    def begin(self, step: int) -> None:
        if step + 1 == self.first:
            self.prof = torch.profiler.profile(activities=self.activities)
            self.prof.__enter__()

    def mark(self, step: int):
        """The step's span in the trace (nothing while not profiling)."""
        if self.prof is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"optimizer step {step + 1}")

    def end(self, step: int) -> None:
        """After the step's time is taken: the trace written after its last step."""
        if self.prof is not None and step + 1 == self.last:
            self.prof.__exit__(None, None, None)
            self.prof.export_chrome_trace(str(self.out))
            self.prof = None


def train(args: argparse.Namespace, cfg, model: GPT, ddp: DDP, opt, batch: Batches, device) -> tuple[list, list]:
    """``train.steps`` steps of gradient accumulation, clipping, AdamW and the schedule; (step times, losses)."""
    t = cfg.train
    accum = t.global_batch_size // (t.micro_batch_size * dist.get_world_size())
    cuda = device.type == "cuda"
    precision = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    rank = dist.get_rank()
    progress = open(args.progress, "a", buffering=1) if args.progress and rank == 0 else None  # noqa: SIM115
    profile = Profile(args, rank, cuda)
    ddp.train()
    step_times: list[float] = []
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(t.steps):
        profile.begin(step)
        with profile.mark(step):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, t.lr, t.min_lr, t.warmup_steps, t.steps)
            for micro in range(accum):
                x = batch()
                with ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                    with precision:
                        logits = ddp(x[:, :-1])
                        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), x[:, 1:].reshape(-1)) / accum
                    loss.backward()
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if (step + 1) % t.log_every == 0:
                losses.append(loss.item() * accum)  # this rank's last micro-batch: what a plain script logs
            if cuda:
                torch.cuda.synchronize()
        step_times.append(time.perf_counter() - started)
        if progress is not None:
            progress.write(f"{step + 1}\n")
        profile.end(step)
        started = time.perf_counter()
    if progress is not None:
        progress.close()
    return step_times, losses


def main() -> int:
    args = parse_args()
    device = init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(args.config, args.overrides)
    model, ddp, opt = build(cfg, device)
    batch = Batches(args.data, cfg, rank, device)
    step_times, losses = train(args, cfg, model, ddp, opt, batch, device)
    if rank == 0:
        t = cfg.train
        result = {
            "world_size": world,
            "threads": torch.get_num_threads(),
            "grad_accum": t.global_batch_size // (t.micro_batch_size * world),
            "tokens_per_step": t.global_batch_size * cfg.model.seq_len,
            "step_time_s": step_times,
            "loss": losses,
        }
        text = json.dumps(result)
        print(text, flush=True)
        if args.json:
            args.json.write_text(text + "\n")
    batch.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
