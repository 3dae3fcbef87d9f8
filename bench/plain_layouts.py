"""Plain torch FSDP2, HSDP, TP + FSDP2 and pipeline parallelism on the trainer's model, config and prepared data.

The sibling of bench/plain_ddp.py for the mesh layouts of bench/parallel.py: what a user would write with torch's
own distributed APIs. Launched by torchrun (``torchrun --standalone --nproc-per-node 4 bench/plain_layouts.py
--layout fsdp --data DIR``); ranks per node from LOCAL_WORLD_SIZE, or PLAIN_RANKS_PER_NODE to simulate several
nodes on one host. The same GPT, batch, AdamW and clipping as plain_ddp.py, with ``dp = world / (tp x pp)`` ranks
sharing the global batch:

- ``fsdp``: ``fully_shard`` on each block, then the root, over all ranks (a 1-D mesh);
- ``hsdp``: the same over a (dp_replicate = nodes, dp_shard = ranks per node) mesh;
- ``tp-fsdp``: tensor parallel inside a node (the GPT's Megatron plan with sequence-parallel norms), then
  ``fully_shard`` across nodes on a (dp_shard, tp) mesh;
- ``pp``: one ``PipelineStage`` per node (``Schedule1F1B``), the ranks of a node replicas of their stage (FSDP2
  over a replicate mesh, as the trainer), the tied embedding and head summed across stages.

Rank 0 prints one JSON object with the per-step times, as plain_ddp.py.
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
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runconfig import load_config  # noqa: E402
from trainer.loop.optim import adamw_impl  # noqa: E402
from trainer.models.gpt import GPT  # noqa: E402

LAYOUTS = ("fsdp", "hsdp", "tp-fsdp", "pp")


def lr_at(step: int, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


class Stage(nn.Module):
    """Pipeline stage ``stage`` of ``stages`` of the GPT: blocks ``n*s//stages .. n*(s+1)//stages`` (as evenly as the
    layers allow), the embeddings on the first stage, the final norm and the (tied) head on the last."""

    def __init__(self, model: GPT, stage: int, stages: int) -> None:
        super().__init__()
        n = len(model.blocks)
        lo, hi = n * stage // stages, n * (stage + 1) // stages
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.tok, self.pos, self.drop = model.tok, model.pos, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def tensor_parallel(model: GPT, mesh) -> None:
    """Megatron-style TP with sequence parallelism (torchtitan's Llama plan): q, k, v and the MLP's first layer split
    by output (heads, hidden units), proj and the MLP's last layer by input and reduce-scattered to a sequence split;
    norms run on 1/tp of the tokens; embeddings and the tied head split by vocabulary, logits gathered for the loss.
    Attention reshapes to ``(b, t, -1, head_dim)``, so each rank's n_heads / tp local heads need no setting."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    plan = {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "blocks.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
        "blocks.*.ln1": SequenceParallel(),
        "blocks.*.attn": PrepareModuleInput(**gather),
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.ln2": SequenceParallel(),
        "blocks.*.mlp": PrepareModuleInput(**gather),
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, plan)
    model.head.weight = model.tok.weight  # parallelize_module gives each module a new parameter: tie them again


def clip(params: list, counted: list, max_norm: float, pp_group) -> None:
    """Clip to the global gradient norm. Sharded (DTensor) gradients give a partial norm: ``full_tensor`` reduces it
    over their mesh (torchtitan's way); pipeline stages add their squared norms over the pp group. ``counted``
    leaves out a tied copy another stage already counts."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in counted if p.grad is not None], 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if pp_group is not None:
        norm = norm.square()
        dist.all_reduce(norm, group=pp_group)
        norm = norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", required=True, choices=LAYOUTS, help="the parallel layout (see the module docstring)")
    p.add_argument("--config", default="tiny", help="config file or example name (default tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--data", type=Path, required=True, help="prepared dataset folder (manifest.json + shards)")
    p.add_argument("--out", type=Path, help="rank 0 also writes its JSON here")
    p.add_argument("--progress", type=Path, help="rank 0 appends a line here after every step (a live step count)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, bf16 as the trainer")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("PLAIN_RANKS_PER_NODE", os.environ["LOCAL_WORLD_SIZE"]))
    nodes = world // per_node
    if world % per_node or (args.layout != "fsdp" and nodes < 2):
        p.error(f"--layout {args.layout}: {world} ranks of {per_node} per node (it needs whole nodes, 2 or more)")
    cfg = load_config(args.config, args.overrides)
    t = cfg.train
    layout = args.layout
    tp = per_node if layout == "tp-fsdp" else 1
    pp = nodes if layout == "pp" else 1
    dp = world // (tp * pp)
    accum = t.global_batch_size // (t.micro_batch_size * dp)
    if accum < 1 or accum * t.micro_batch_size * dp != t.global_batch_size:
        p.error(f"train.global_batch_size {t.global_batch_size} is not a multiple of micro_batch_size x dp {dp}")
    window = cfg.model.seq_len + 1
    bf16 = cuda and t.bf16_on("cuda")
    # The trainer's FSDP2 precision: bf16 compute copies of the gathered parameters, fp32 gradient reduction.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    mp_kw = {"mp_policy": mp} if mp is not None else {}
    dp_shard = {"fsdp": world, "hsdp": per_node, "tp-fsdp": nodes, "pp": 1}[layout]
    reshard = cfg.parallel.fsdp_reshard_after_forward and dp_shard > 1  # the trainer's: nothing to free otherwise

    torch.manual_seed(t.seed)
    model = GPT(cfg.model).to(device)
    no_sync = contextlib.nullcontext  # around the micro-batches that only accumulate gradients
    pipe = pp_group = None
    tied: list[tuple] = []
    counted_names: set[str] | None = None
    if layout in ("fsdp", "hsdp", "tp-fsdp"):
        if layout == "fsdp":
            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
            dp_rank = rank
        elif layout == "hsdp":
            mesh = init_device_mesh(device.type, (nodes, per_node), mesh_dim_names=("dp_replicate", "dp_shard"))
            dp_rank = rank
        else:  # TP groups are consecutive ranks (one node); all ranks of a group see the same batch
            mesh2 = init_device_mesh(device.type, (nodes, per_node), mesh_dim_names=("dp_shard", "tp"))
            tensor_parallel(model, mesh2["tp"])  # first (torchtitan's order): FSDP2 then shards the DTensors
            mesh = mesh2["dp_shard"]
            dp_rank = rank // tp
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again at once by backward: keep them gathered, as the trainer.
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard and i < len(blocks) - 1, **mp_kw)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **mp_kw)
        if layout == "hsdp":  # reduce-scatter every micro-batch, all-reduce across nodes only on the last one
            no_sync = _no_all_reduce(model)
        trained = model
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        # (pp, dp_replicate, dp_shard = 1): FSDP2 over (dp, 1) is whole replicas all-reduced, the trainer's pp x dp.
        mesh3 = init_device_mesh(device.type, (pp, per_node, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
        stage_index, dp_rank = rank // per_node, rank % per_node
        trained = Stage(model, stage_index, pp)
        del model
        for block in trained.blocks.values():  # each block runs once per pipeline micro-batch: keep it gathered
            fully_shard(block, mesh=mesh3["dp_replicate", "dp_shard"], reshard_after_forward=False, **mp_kw)
        fully_shard(trained, mesh=mesh3["dp_replicate", "dp_shard"], reshard_after_forward=False, **mp_kw)
        no_sync = _no_all_reduce(trained)
        pp_group = mesh3["pp"].get_group()
        microbatches = cfg.parallel.pp_microbatches or pp
        scale = 1.0 / (microbatches * accum)  # scale the loss, not the grads: accumulated .grad stays as it is

        def pp_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1)) * scale

        runner = PipelineStage(trained, stage_index, pp, device, group=pp_group)
        pipe = Schedule1F1B(runner, microbatches, loss_fn=pp_loss, scale_grads=False)
        # The embedding (first stage) and the head (last) are one weight in the GPT: each holds a copy, their
        # gradients summed after each step between the ranks of the same dp index (one group per dp index).
        for i in range(per_node):
            ranks = [0 * per_node + i, (pp - 1) * per_node + i]
            group = dist.new_group(ranks)
            if rank in ranks:
                tied.append((group, trained.tok.weight if trained.first else trained.head.weight))
        counted_names = {"head.weight"} if trained.last else set()  # the norm counts the tied weight once
    precision = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    params = list(trained.parameters())
    counted = params if counted_names is None else [q for n, q in trained.named_parameters() if n not in counted_names]
    decay = [q for q in params if q.dim() >= 2]
    no_decay = [q for q in params if q.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        **adamw_impl(t.optimizer_impl),  # the trainer's kernels: the comparison is of everything around them
    )

    manifest = json.loads((args.data / "manifest.json").read_text())
    files = [h5py.File(args.data / s["file"], "r") for s in manifest["splits"]["train"]]
    shards = [f["tokens"] for f in files]
    rng = np.random.default_rng(t.seed * 1000 + dp_rank)  # by data-parallel rank: TP and pp peers share batches

    def batch() -> torch.Tensor:
        rows = []
        for _ in range(t.micro_batch_size):
            ds = shards[rng.integers(len(shards))]
            start = int(rng.integers(len(ds) - window))
            rows.append(ds[start : start + window])
        return torch.from_numpy(np.stack(rows).astype(np.int64)).to(device, non_blocking=True)

    trained.train()
    progress = open(args.progress, "a", buffering=1) if args.progress and rank == 0 else None  # noqa: SIM115
    step_times: list[float] = []
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(t.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t.lr, t.min_lr, t.warmup_steps, t.steps)
        for micro in range(accum):
            x = batch()
            with no_sync() if micro < accum - 1 else contextlib.nullcontext(), precision:
                if pipe is None:
                    logits = trained(x[:, :-1])
                    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), x[:, 1:].reshape(-1)) / accum
                    loss.backward()
                else:
                    chunks: list[torch.Tensor] = []
                    if stage_index == 0:
                        pipe.step(x[:, :-1])
                    elif stage_index == pp - 1:
                        pipe.step(target=x[:, 1:], losses=chunks)
                    else:
                        pipe.step()
                    loss = torch.stack(chunks).sum().detach() if chunks else torch.zeros((), device=device)
        for group, param in tied:
            grad = param.grad
            if grad.placements != param.placements:
                grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
            dist.all_reduce(grad.to_local(), group=group)
        if t.grad_clip > 0:
            clip(params, counted, t.grad_clip, pp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % t.log_every == 0:
            if pipe is not None:  # only the last stage has the loss: it sends it to the other stages of its column
                loss = loss.clone()
                dist.broadcast(loss, group=pp_group, group_src=pp - 1)
            losses.append(loss.item() * accum)  # this rank's last micro-batch: what a plain script logs
        if cuda:
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - started)
        if progress is not None:
            progress.write(f"{step + 1}\n")
        started = time.perf_counter()

    if rank == 0:
        result = {
            "layout": layout,
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


def _no_all_reduce(module: nn.Module):
    """HSDP's (and the replicated stages') accumulation: skip the all-reduce across replicas until the last
    micro-batch, as the trainer does."""

    @contextlib.contextmanager
    def ctx():
        module.set_requires_all_reduce(False)
        try:
            yield
        finally:
            module.set_requires_all_reduce(True)

    return ctx


if __name__ == "__main__":
    sys.exit(main())
