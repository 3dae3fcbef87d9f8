"""Worker: DDP with each algorithm's hook (hierarchical, leader, two_level, and auto with a plan measured here) vs
plain DDP, K AdamW steps from the same weights on the same batches, and the overlapped hook (the trainer's, on its
own thread) vs the same algorithm run synchronously in the hook; and the trainer's start-up check of the overlapped
path, on the real path and on one that skips the reduction.

The all-reduce is wired by trainer.parallel.wrap.wire_allreduce, the trainer's own code path, for several bucket sizes.
argv: OUT_DIR STEPS
"""

import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch
from mpi4py import MPI

from runconfig import load_config
from rundir.allreduce_plan import choose
from trainer.env import from_mpi
from trainer.loop.optim import build_optimizer
from trainer.models.gpt import GPT, loss_fn
from trainer.parallel.autotune import measure
from trainer.parallel.comm import BucketDispatch, check_overlapped, sync_hook
from trainer.parallel.distributed import init_distributed, shutdown
from trainer.parallel.wrap import hook_up, wire_allreduce

out_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
comm = MPI.COMM_WORLD
env = from_mpi(comm)
torch.set_num_threads(1)
base = load_config("tiny", ["model.d_model=32", "model.n_layers=2", "model.seq_len=16"])
d = init_distributed(env, base.comm, torch.device("cpu"), comm)
PLAN = measure(d.groups, [1024, 40_000, 400_000], torch.device("cpu"))  # the 3 bucket sizes below, roughly


def train(allreduce: str, bucket_mb: float, sync: bool = False) -> tuple[dict, str | None]:
    cfg = dataclasses.replace(base, comm=dataclasses.replace(base.comm, allreduce=allreduce, bucket_mb=bucket_mb))
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.comm.bucket_mb)
    if sync:
        dispatch = BucketDispatch(d.groups, None if allreduce == "auto" else allreduce)
        ddp.register_comm_hook(dispatch, sync_hook)
    else:
        wired, dispatch = wire_allreduce(cfg, env, d, ddp)
        assert wired == allreduce
    if dispatch is not None and allreduce == "auto":
        dispatch.plan = functools.partial(choose, PLAN)
        if not sync:  # as trainer.build.plan_allreduce: auto's hook is registered once its plan is known
            hook_up(cfg, d, ddp, dispatch)
    optimizer = build_optimizer(model, cfg.train)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(100 + env.rank)  # different data on every rank, same for both runs
    for _ in range(steps):
        batch = torch.randint(0, 257, (4, 17), generator=g)
        loss = loss_fn(ddp(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    hook = ddp._get_ddp_logging_data().get("comm_hook")
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = max(float((final[n] - initial[n]).abs().max()) for n in final)
    return final, hook, moved


plain, plain_hook, moved = train("flat", 25.0)
result = {"rank": env.rank, "plain_hook": plain_hook, "moved": moved, "runs": {}}
runs = [("hierarchical", b) for b in (25.0, 0.01, 0.003)] + [(a, 0.01) for a in ("leader", "two_level", "auto")]
for allreduce, bucket_mb in runs:
    hooked, hook, _ = train(allreduce, bucket_mb)
    diff = max(float((hooked[n] - plain[n]).abs().max()) for n in plain)
    synced, synced_hook, _ = train(allreduce, bucket_mb, sync=True)
    same = all(torch.equal(hooked[n], synced[n]) for n in hooked)
    result["runs"][f"{allreduce} {bucket_mb}"] = {
        "max_abs_diff": diff, "hook": hook, "sync_hook": synced_hook, "same_as_sync": same
    }  # fmt: skip
result["plan"] = [row["choice"] for row in PLAN["sizes"]]

# The start-up check of the overlapped path (trainer.build.check_overlap): the reducer's thread gives the synchronous
# bits; a path that returns the bucket unreduced is caught, on every rank.
cfg = dataclasses.replace(base, comm=dataclasses.replace(base.comm, allreduce="hierarchical"))
_, dispatch = wire_allreduce(cfg, env, d, torch.nn.parallel.DistributedDataParallel(GPT(cfg.model)))
result["check_real"] = check_overlapped(dispatch, [1024, 40_000, 400_000], torch.device("cpu"))


def unreduced(buf: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


dispatch.overlapped = unreduced
result["check_unreduced"] = check_overlapped(dispatch, [1024], torch.device("cpu"))
(out_dir / f"rank_{env.rank}.json").write_text(json.dumps(result))
shutdown(comm, clean=True)
