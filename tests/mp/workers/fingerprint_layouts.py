"""Worker: params_sha256 of the same weights whole on every rank (DDP), sharded by FSDP2 over 4 ranks, by HSDP
(2 x 2), by tensor parallelism (2 replicas x tp 2), by TP x FSDP (2-D), cut into pipeline stages (2 stages x 2
replicas; 2 stages x tp 2: each rank holds other names, the tied head a copy of the embedding) against the
single-process value; and the per-rank hashing share. Then each layout again built on the meta device and
materialised after the split (parallel.meta_init).
argv: OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
from mpi4py import MPI

from runconfig import load_config
from runconfig.layout import Layout
from trainer.checkpoint import fingerprint
from trainer.env import from_mpi
from trainer.models.gpt import GPT, pipeline, tp_plan
from trainer.parallel.distributed import init_distributed, shutdown
from trainer.parallel.fsdp import find_blocks, shard
from trainer.parallel.materialise import materialise, owners, params_on_meta
from trainer.parallel.mesh import dp_mesh, train_mesh
from trainer.parallel.pipeline import cut
from trainer.parallel.tp import tensor_parallel

out_dir = Path(sys.argv[1])
comm = MPI.COMM_WORLD
env = from_mpi(comm)
torch.set_num_threads(1)
cfg = load_config("tiny", ["model.d_model=36", "model.n_layers=2", "model.seq_len=16", "model.vocab_size=259"])
d = init_distributed(env, cfg.comm, torch.device("cpu"), comm)


def model() -> GPT:
    torch.manual_seed(3)
    return GPT(cfg.model)


hashed: list[str] = []
original = fingerprint.param_digest


def counting(name, t):
    hashed.append(name)
    return original(name, t)


fingerprint.param_digest = counting
result = {"rank": env.rank, "whole": fingerprint.params_sha256(model()), "hashed_whole": list(hashed)}
layouts = {
    "fsdp": Layout(dp_shard=4),
    "hsdp": Layout(dp_replicate=2, dp_shard=2),
    "tp": Layout(dp_replicate=2, tp=2),
    "tp_fsdp": Layout(dp_shard=2, tp=2),
    "pp": Layout(pp=2, dp_replicate=2),
    "pp_tp": Layout(pp=2, tp=2),
}


def split(m: GPT, layout: Layout) -> tuple[GPT, frozenset | dict]:
    """This rank's part of ``m`` under ``layout`` (as trainer.parallel.wrap splits it), and the tied aliases."""
    skip: frozenset | dict = frozenset()
    mesh = train_mesh(layout, d.device)
    if layout.pp > 1:
        m, info = cut(m, pipeline(), layout, env.rank, spec="gpt")
        skip = info["aliases"]
    if layout.tp > 1:
        tensor_parallel(m, tp_plan, mesh["tp"], recipe="gpt")
    if layout.dp_shard > 1:
        blocks = find_blocks(m, None, recipe="gpt")
        shard(m, blocks, dp_mesh(mesh, layout), param_dtype=None, reshard_after_forward=True)
    return m, skip


for name, layout in layouts.items():
    m, skip = split(model(), layout)
    hashed.clear()
    result[name] = fingerprint.params_sha256(m, skip=skip)
    result[f"hashed_{name}"] = list(hashed)
    if layout.pp == 1:
        result[f"v1_{name}"] = fingerprint.params_sha256_v1(m.named_parameters())
# parallel.meta_init: the same layouts built on the meta device and materialised after the split, each rank its part
for name, layout in {"whole": Layout(dp_replicate=4), **layouts}.items():
    with params_on_meta():
        whole = model()
    plan = owners(whole)  # before the split, which replaces parameters (and unties a pipeline's copies)
    m, skip = split(whole, layout)
    assert materialise(m, plan, whole.init_weights, seed=0, device=d.device, spec="gpt") is None
    result[f"meta_{name}"] = fingerprint.params_sha256(m, skip=skip)
(out_dir / f"rank_{env.rank}.json").write_text(json.dumps(result))
shutdown(comm, clean=True)
