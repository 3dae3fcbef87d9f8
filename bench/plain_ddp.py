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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help="config file or example name (default tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--data", type=Path, required=True, help="prepared dataset folder (manifest.json + shards)")
    p.add_argument("--out", type=Path, help="rank 0 also writes its JSON here")
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
    first = last = 0
    if args.profile_steps:
        first, last = (int(x) for x in args.profile_steps.split("-"))
        if not args.profile_out:
            p.error("--profile-steps needs --profile-out")

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(args.config, args.overrides)
    t = cfg.train
    accum = t.global_batch_size // (t.micro_batch_size * world)
    window = cfg.model.seq_len + 1

    torch.manual_seed(t.seed)
    model = GPT(cfg.model).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None, **ddp_bucket_caps(cfg.comm))
    precision = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        **adamw_impl(t.optimizer_impl),  # the trainer's kernels: the comparison is of everything around them
    )

    manifest = json.loads((args.data / "manifest.json").read_text())
    files = [h5py.File(args.data / s["file"], "r") for s in manifest["splits"]["train"]]
    shards = [f["tokens"] for f in files]
    rng = np.random.default_rng(t.seed * 1000 + rank)

    def batch() -> torch.Tensor:
        rows = []
        for _ in range(t.micro_batch_size):
            ds = shards[rng.integers(len(shards))]
            start = int(rng.integers(len(ds) - window))
            rows.append(ds[start : start + window])
        return torch.from_numpy(np.stack(rows).astype(np.int64)).to(device, non_blocking=True)

    ddp.train()
    progress = open(args.progress, "a", buffering=1) if args.progress and rank == 0 else None  # noqa: SIM115
    step_times: list[float] = []
    losses: list[float] = []
    prof = None
    started = time.perf_counter()
    for step in range(t.steps):
        if rank == 0 and step + 1 == first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=activities)
            prof.__enter__()
        mark = torch.profiler.record_function(f"optimizer step {step + 1}") if prof is not None else None
        if mark is not None:
            mark.__enter__()
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
        if mark is not None:
            mark.__exit__(None, None, None)
        step_times.append(time.perf_counter() - started)
        if progress is not None:
            progress.write(f"{step + 1}\n")
        if prof is not None and step + 1 == last:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(str(args.profile_out))
            prof = None
        started = time.perf_counter()

    if rank == 0:
        result = {
            "world_size": world,
            "threads": torch.get_num_threads(),
            "grad_accum": accum,
            "tokens_per_step": t.global_batch_size * cfg.model.seq_len,
            "step_time_s": step_times,
            "loss": losses,
        }
        text = json.dumps(result)
        print(text, flush=True)
        if args.out:
            args.out.write_text(text + "\n")
    for f in files:
        f.close()
    if progress is not None:
        progress.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
