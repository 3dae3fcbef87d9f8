"""Plain torch FSDP2, HSDP, TP + FSDP2, context and pipeline parallelism on the trainer's model, config and data.

The sibling of bench/plain_ddp.py for the mesh layouts of bench/parallel.py: what a user would write with torch's
own distributed APIs. Launched by torchrun (``torchrun --standalone --nproc-per-node 4 bench/plain_layouts.py
--layout fsdp --data DIR``); ranks per node from LOCAL_WORLD_SIZE, or PLAIN_RANKS_PER_NODE to simulate several
nodes on one host. The same GPT, batch, AdamW and clipping as plain_ddp.py, with ``dp = world / (tp x pp)`` ranks
sharing the global batch:

- ``fsdp``: ``fully_shard`` on each block, then the root, over all ranks (a 1-D mesh);
- ``hsdp``: the same over a (dp_replicate = nodes, dp_shard = ranks per node) mesh;
- ``tp-fsdp``: tensor parallel inside a node (the GPT's Megatron plan with sequence-parallel norms), then
  ``fully_shard`` across nodes on a (dp_shard, tp) mesh;
- ``cp``: each sequence over the ranks of a node (torch's ``context_parallel()`` around forward and backward,
  the input, targets and positions sharded head-and-tail), ``fully_shard`` on a (dp_replicate = nodes, cp) mesh as
  the trainer's FSDP2 over dp_shard x cp; on CPU with the ring's CPU kernels (trainer/parallel/cp.py: torch has
  none), the GPT's positions handed over as the trainer does (``trainer.recipes.api.positions``);
- ``pp``: one ``PipelineStage`` per node (``Schedule1F1B``), the ranks of a node replicas of their stage (FSDP2
  over a replicate mesh, as the trainer), the tied embedding and head summed across stages. With the config's
  ``parallel.pp_schedule`` an interleaved or V schedule (one rank a node, no data parallelism, as the trainer):
  ``parallel.pp_stages_per_rank`` stages a rank, placed as torch places them (rank r: r, r + pp, ...; V: r and
  2 pp - 1 - r), each a ``PipelineStage``.

Rank 0 prints one JSON object with the per-step times, as plain_ddp.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# the plain DDP script's learning-rate schedule, process-group set-up and batches (bench/ is on sys.path)
from plain_ddp import Batches, init, lr_at  # noqa: E402

from runconfig import load_config  # noqa: E402
from trainer.loop.optim import adamw_impl  # noqa: E402
from trainer.models.gpt import GPT  # noqa: E402

LAYOUTS = ("fsdp", "hsdp", "tp-fsdp", "cp", "pp")


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


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", required=True, choices=LAYOUTS, help="the parallel layout (see the module docstring)")
    p.add_argument("--config", default="tiny", help="config file or example name (default tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--data", type=Path, required=True, help="prepared dataset folder (manifest.json + shards)")
    p.add_argument("--json", type=Path, metavar="PATH", help="rank 0 also writes its JSON object to this file")
    p.add_argument("--progress", type=Path, help="rank 0 appends a line here after every step (a live step count)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, bf16 as the trainer")
    return p, p.parse_args()


@dataclasses.dataclass
class Shape:
    """How the layout splits the ranks: nodes of ``per_node`` ranks, tensor- and pipeline-parallel degrees, the
    data-parallel ranks that share the global batch, micro-batches per step, FSDP2's shard degree."""

    layout: str
    world: int
    per_node: int
    nodes: int
    tp: int
    pp: int
    cp: int
    dp: int
    accum: int
    dp_shard: int


def shape_of(p: argparse.ArgumentParser, layout: str, cfg) -> Shape:
    world = dist.get_world_size()
    per_node = int(os.environ.get("PLAIN_RANKS_PER_NODE", os.environ["LOCAL_WORLD_SIZE"]))
    nodes = world // per_node
    if world % per_node or (layout not in ("fsdp", "cp") and nodes < 2):
        p.error(f"--layout {layout}: {world} ranks of {per_node} per node (it needs whole nodes, 2 or more)")
    t = cfg.train
    tp = per_node if layout == "tp-fsdp" else 1
    pp = nodes if layout == "pp" else 1
    cp = per_node if layout == "cp" else 1
    dp = world // (tp * pp * cp)
    accum = t.global_batch_size // (t.micro_batch_size * dp)
    if accum < 1 or accum * t.micro_batch_size * dp != t.global_batch_size:
        p.error(f"train.global_batch_size {t.global_batch_size} is not a multiple of micro_batch_size x dp {dp}")
    dp_shard = {"fsdp": world, "hsdp": per_node, "tp-fsdp": nodes, "cp": per_node, "pp": 1}[layout]
    return Shape(layout, world, per_node, nodes, tp, pp, cp, dp, accum, dp_shard)


@dataclasses.dataclass
class Parallel:
    """The model as the layout trains it: the module (or this rank's pipeline stage), the context that skips the
    all-reduce across replicas on the micro-batches that only accumulate, this rank's data-parallel index; for pp
    also the schedule, the pp group, this rank's stage, the tied weights to sum and the names the norm leaves out."""

    trained: nn.Module
    dp_rank: int
    no_sync: Callable = contextlib.nullcontext
    pipe: object = None
    pp_group: object = None
    stage_index: int = 0
    tied: list = dataclasses.field(default_factory=list)
    counted_names: set[str] | None = None
    first: bool | None = None  # several stages a rank: whether it holds the first, the last (else by stage_index)
    last: bool | None = None
    loss_src: int | None = None  # the pp group's rank that holds the last stage (default: the last rank)
    cp_mesh: object = None


def sharded(model: GPT, s: Shape, device: torch.device, reshard: bool, mp_kw: dict) -> Parallel:
    """fsdp, hsdp, tp-fsdp: ``fully_shard`` on each block, then the root, over the layout's mesh (after TP)."""
    rank = dist.get_rank()
    if s.layout == "fsdp":
        mesh = init_device_mesh(device.type, (s.world,), mesh_dim_names=("dp_shard",))
        dp_rank = rank
    elif s.layout == "hsdp":
        mesh = init_device_mesh(device.type, (s.nodes, s.per_node), mesh_dim_names=("dp_replicate", "dp_shard"))
        dp_rank = rank
    elif s.layout == "cp":  # a node's ranks share a batch, each holding a part of every sequence; FSDP2 over
        # dp_shard x cp flattened, a process group of its own beside the ring's (torchtitan's dp_shard_cp)
        dims = ("dp_replicate", "dp_shard", "cp")
        full = init_device_mesh(device.type, (s.nodes, 1, s.per_node), mesh_dim_names=dims)
        full["dp_shard", "cp"]._flatten("dp_shard_cp")
        cp_mesh, mesh = full["cp"], full["dp_replicate", "dp_shard_cp"]
        dp_rank = rank // s.per_node
    else:  # TP groups are consecutive ranks (one node); all ranks of a group see the same batch
        mesh2 = init_device_mesh(device.type, (s.nodes, s.per_node), mesh_dim_names=("dp_shard", "tp"))
        tensor_parallel(model, mesh2["tp"])  # first (torchtitan's order): FSDP2 then shards the DTensors
        mesh = mesh2["dp_shard"]
        dp_rank = rank // s.tp
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered, as the trainer.
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard and i < len(blocks) - 1, **mp_kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **mp_kw)
    out = Parallel(model, dp_rank)
    if s.layout == "cp":
        out.cp_mesh = cp_mesh
        if device.type == "cpu":
            from trainer.parallel.cp import _enable_cpu_kernels

            _enable_cpu_kernels()
    if s.layout in ("hsdp", "cp"):  # reduce-scatter every micro-batch, all-reduce across nodes only on the last one
        out.no_sync = _no_all_reduce(model)
    return out


def pipelined(model: GPT, s: Shape, device: torch.device, microbatches: int, mp_kw: dict) -> Parallel:
    """pp: one stage per node under ``Schedule1F1B``, the ranks of a node replicas of their stage (FSDP2 over a
    replicate mesh, as the trainer), the tied embedding and head summed across stages."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, pp, per_node = dist.get_rank(), s.pp, s.per_node
    # (pp, dp_replicate, dp_shard = 1): FSDP2 over (dp, 1) is whole replicas all-reduced, the trainer's pp x dp.
    mesh3 = init_device_mesh(device.type, (pp, per_node, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    stage_index, dp_rank = rank // per_node, rank % per_node
    trained = Stage(model, stage_index, pp)
    del model  # the other stages' blocks
    for block in trained.blocks.values():  # each block runs once per pipeline micro-batch: keep it gathered
        fully_shard(block, mesh=mesh3["dp_replicate", "dp_shard"], reshard_after_forward=False, **mp_kw)
    fully_shard(trained, mesh=mesh3["dp_replicate", "dp_shard"], reshard_after_forward=False, **mp_kw)
    pp_group = mesh3["pp"].get_group()
    scale = 1.0 / (microbatches * s.accum)  # scale the loss, not the grads: accumulated .grad stays as it is

    def pp_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1)) * scale

    runner = PipelineStage(trained, stage_index, pp, device, group=pp_group)
    pipe = Schedule1F1B(runner, microbatches, loss_fn=pp_loss, scale_grads=False)
    # The embedding (first stage) and the head (last) are one weight in the GPT: each holds a copy, their
    # gradients summed after each step between the ranks of the same dp index (one group per dp index).
    tied = []
    for i in range(per_node):
        ranks = [0 * per_node + i, (pp - 1) * per_node + i]
        group = dist.new_group(ranks)
        if rank in ranks:
            tied.append((group, trained.tok.weight if trained.first else trained.head.weight))
    counted_names = {"head.weight"} if trained.last else set()  # the norm counts the tied weight once
    return Parallel(trained, dp_rank, _no_all_reduce(trained), pipe, pp_group, stage_index, tied, counted_names)


def interleaved(model: GPT, s: Shape, device: torch.device, microbatches: int, kind: str, per_rank: int) -> Parallel:
    """pp alone with ``per_rank`` stages a rank under torch's ``Schedule<kind>``: the stages of a rank share the
    model's modules (under a V the first rank holds the embedding and the tied head: one weight), the tie summed
    across ranks where two ranks hold it."""
    import torch.distributed.pipelining as pipelining

    rank, pp = dist.get_rank(), s.pp
    stages = pp * per_rank
    v = kind in ("ZBVZeroBubble", "DualPipeV")
    held = [st for st in range(stages) if (2 * pp - 1 - st if v and st >= pp else st % pp) == rank]
    parts = [Stage(model, st, stages) for st in held]
    trained = nn.ModuleList(parts)  # the union of this rank's stages (a module shared by two is listed once)
    del model
    pp_group = dist.new_group(list(range(pp)))
    scale = 1.0 / (microbatches * s.accum)

    def pp_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1)) * scale

    runners = [
        pipelining.PipelineStage(part, st, stages, device, group=pp_group) for st, part in zip(held, parts, strict=True)
    ]
    pipe = getattr(pipelining, f"Schedule{kind}")(runners, microbatches, loss_fn=pp_loss, scale_grads=False)
    first, last = 0 in held, stages - 1 in held
    last_rank = (2 * pp - 1 - (stages - 1)) if v else (stages - 1) % pp
    holders = sorted({0, last_rank})
    tied, counted_names = [], set()
    if len(holders) > 1:  # the embedding and the head on two ranks: sum their gradients after each step
        group = dist.new_group(holders)
        if first or last:
            tied.append((group, parts[held.index(0)].tok.weight if first else parts[-1].head.weight))
        if last and not first:
            counted_names = {n for n, _ in trained.named_parameters() if n.endswith("head.weight")}
    out = Parallel(trained, 0, contextlib.nullcontext, pipe, pp_group, 0, tied, counted_names)
    out.first, out.last, out.loss_src = first, last, last_rank
    return out


def parallelize(cfg, s: Shape, device: torch.device) -> Parallel:
    """The GPT under the layout, with the trainer's FSDP2 precision: bf16 compute copies of the gathered
    parameters and fp32 gradient reduction on CUDA."""
    bf16 = device.type == "cuda" and cfg.train.bf16_on("cuda")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    mp_kw = {"mp_policy": mp} if mp is not None else {}
    torch.manual_seed(cfg.train.seed)
    if s.layout == "pp":  # the whole model only until this rank's stage is cut from it
        kind, n = cfg.parallel.pp_schedule, cfg.parallel.pp_microbatches or s.pp
        if kind not in ("1F1B", "GPipe"):
            model = GPT(cfg.model).to(device)
            return interleaved(model, s, device, n, kind, cfg.parallel.pp_stages_per_rank)
        return pipelined(GPT(cfg.model).to(device), s, device, n, mp_kw)
    reshard = cfg.parallel.fsdp_reshard_after_forward and s.dp_shard > 1  # the trainer's: nothing to free otherwise
    return sharded(GPT(cfg.model).to(device), s, device, reshard, mp_kw)


def adamw(params: list, t) -> torch.optim.Optimizer:
    decay = [q for q in params if q.dim() >= 2]
    no_decay = [q for q in params if q.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        **adamw_impl(t.optimizer_impl),  # the trainer's kernels: the comparison is of everything around them
    )


def forward_backward(m: Parallel, x: torch.Tensor, s: Shape, device: torch.device) -> torch.Tensor:
    """One micro-batch: forward and backward (through the pipeline schedule for pp); this rank's loss."""
    if m.cp_mesh is not None:
        return cp_forward_backward(m, x, s)
    if m.pipe is None:
        logits = m.trained(x[:, :-1])
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), x[:, 1:].reshape(-1)) / s.accum
        loss.backward()
        return loss
    chunks: list[torch.Tensor] = []
    first = m.stage_index == 0 if m.first is None else m.first
    last = m.stage_index == s.pp - 1 if m.last is None else m.last
    if first and last:  # a V's first rank
        m.pipe.step(x[:, :-1], target=x[:, 1:], losses=chunks)
    elif first:
        m.pipe.step(x[:, :-1])
    elif last:
        m.pipe.step(target=x[:, 1:], losses=chunks)
    else:
        m.pipe.step()
    return torch.stack(chunks).sum().detach() if chunks else torch.zeros((), device=device)


def cp_forward_backward(m: Parallel, x: torch.Tensor, s: Shape) -> torch.Tensor:
    """One micro-batch with its sequences split over the cp group: this rank's loss (of its tokens)."""
    from torch.distributed.tensor.experimental import context_parallel

    from trainer.recipes import api

    inputs, targets = x[:, :-1].clone(), x[:, 1:].clone()
    where = torch.arange(inputs.shape[1], device=x.device).unsqueeze(0)
    buffers = [inputs, targets, where]
    with context_parallel(m.cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
        api._positions = where[0]
        logits = m.trained(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) / s.accum
        loss.backward()
        api._positions = None
    return loss


def sum_tied(m: Parallel) -> None:
    """Sum the tied embedding's and head's gradients across the first and the last stage."""
    for group, param in m.tied:
        grad = param.grad
        if isinstance(grad, DTensor):  # FSDP2's replicas of a stage
            if grad.placements != param.placements:
                grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
            grad = grad.to_local()
        dist.all_reduce(grad, group=group)


def train(args: argparse.Namespace, cfg, s: Shape, m: Parallel, batch: Batches, device) -> tuple[list, list]:
    """``train.steps`` steps of gradient accumulation, clipping, AdamW and the schedule; (step times, losses)."""
    t = cfg.train
    cuda = device.type == "cuda"
    precision = torch.autocast("cuda", dtype=torch.bfloat16) if cuda and t.bf16_on("cuda") else contextlib.nullcontext()
    params = list(m.trained.parameters())
    named = m.trained.named_parameters()
    counted = params if m.counted_names is None else [q for n, q in named if n not in m.counted_names]
    opt = adamw(params, t)
    m.trained.train()
    progress = open(args.progress, "a", buffering=1) if args.progress and dist.get_rank() == 0 else None  # noqa: SIM115
    step_times: list[float] = []
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(t.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t.lr, t.min_lr, t.warmup_steps, t.steps)
        for micro in range(s.accum):
            x = batch()
            with m.no_sync() if micro < s.accum - 1 else contextlib.nullcontext(), precision:
                loss = forward_backward(m, x, s, device)
        sum_tied(m)
        if t.grad_clip > 0:
            clip(params, counted, t.grad_clip, m.pp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % t.log_every == 0:
            if m.pipe is not None:  # only the last stage has the loss: it sends it to the other stages of its column
                loss = loss.clone()
                dist.broadcast(loss, group=m.pp_group, group_src=s.pp - 1 if m.loss_src is None else m.loss_src)
            losses.append(loss.item() * s.accum)  # this rank's last micro-batch: what a plain script logs
        if cuda:
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - started)
        if progress is not None:
            progress.write(f"{step + 1}\n")
        started = time.perf_counter()
    if progress is not None:
        progress.close()
    return step_times, losses


def main() -> int:
    p, args = parse_args()
    device = init(args.device)
    cfg = load_config(args.config, args.overrides)
    s = shape_of(p, args.layout, cfg)
    m = parallelize(cfg, s, device)
    batch = Batches(args.data, cfg, m.dp_rank, device)
    step_times, losses = train(args, cfg, s, m, batch, device)
    if dist.get_rank() == 0:
        result = {
            "layout": s.layout,
            "world_size": s.world,
            "threads": torch.get_num_threads(),
            "grad_accum": s.accum,
            "tokens_per_step": cfg.train.global_batch_size * cfg.model.seq_len,
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
