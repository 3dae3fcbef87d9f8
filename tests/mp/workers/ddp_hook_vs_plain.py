"""Worker: DDP with the hierarchical hook vs plain DDP, K AdamW steps from the same weights on the same batches,
and the overlapped hook (the trainer's, on its own thread) vs the same phases run synchronously in the hook.

The all-reduce is wired by trainer.parallel.wrap.wire_allreduce, the trainer's own code path, for several bucket sizes.
argv: OUT_DIR STEPS
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
from mpi4py import MPI

from runconfig import load_config
from trainer.env import from_mpi
from trainer.loop.optim import build_optimizer
from trainer.models.gpt import GPT, loss_fn
from trainer.parallel.comm import hierarchical_hook
from trainer.parallel.distributed import init_distributed, shutdown
from trainer.parallel.wrap import wire_allreduce

out_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
comm = MPI.COMM_WORLD
env = from_mpi(comm)
torch.set_num_threads(1)
base = load_config("tiny", ["model.d_model=32", "model.n_layers=2", "model.seq_len=16"])
d = init_distributed(env, base.comm, torch.device("cpu"), comm)


def train(allreduce: str, bucket_mb: float, sync: bool = False) -> tuple[dict, str | None]:
    cfg = dataclasses.replace(base, comm=dataclasses.replace(base.comm, allreduce=allreduce, bucket_mb=bucket_mb))
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.comm.bucket_mb)
    if sync:
        ddp.register_comm_hook(d.groups, hierarchical_hook)
    else:
        assert wire_allreduce(cfg, env, d, ddp) == allreduce
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
for bucket_mb in (25.0, 0.01, 0.003):
    hier, hook, _ = train("hierarchical", bucket_mb)
    diff = max(float((hier[n] - plain[n]).abs().max()) for n in plain)
    sync, sync_hook, _ = train("hierarchical", bucket_mb, sync=True)
    same = all(torch.equal(hier[n], sync[n]) for n in hier)
    result["runs"][str(bucket_mb)] = {"max_abs_diff": diff, "hook": hook, "sync_hook": sync_hook, "same_as_sync": same}
(out_dir / f"rank_{env.rank}.json").write_text(json.dumps(result))
shutdown(comm, clean=True)
