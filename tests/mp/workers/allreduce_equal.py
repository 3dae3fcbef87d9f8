"""Worker: every all-reduce algorithm (hierarchical, leader, two_level, and flat on its own world group) ==
torch's flat all-reduce exactly on integer-valued tensors of awkward sizes, the hierarchical one whole and
pipelined over chunks; the algorithms of an auto plan measured on these groups too; with
comm.compress=bf16 (the inter-node phase in bfloat16) still exactly on small integers, whose per-node partial
sums bfloat16 holds exactly, and within bfloat16 rounding (but not exactly, where nodes are crossed) on fractions."""

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

from runconfig.schema import CommConfig
from rundir.allreduce_plan import choose
from trainer.env import from_mpi
from trainer.parallel.autotune import measure
from trainer.parallel.comm import ALGORITHMS, hierarchical_all_reduce
from trainer.parallel.distributed import gloo_threads, init_distributed, shutdown

comm = MPI.COMM_WORLD
env = from_mpi(comm)
d = init_distributed(env, CommConfig(timeout_s=60), torch.device("cpu"), comm)
results = {}
for size in [1, 2, 5, 7, 1000, 12_345, 65_537]:
    g = torch.Generator().manual_seed(1000 * size + env.rank)
    x = torch.randint(-1000, 1000, (size,), generator=g).float()
    flat = x.clone()
    dist.all_reduce(flat)
    for name, algorithm in ALGORITHMS.items():
        results[f"{size}_{name}"] = bool(torch.equal(flat, algorithm(x.clone(), d.groups)))
    # pipelined over chunks: of 12 elements (one to six per rank of a node) for the small sizes, of 1024 for the
    # others; uneven last chunks
    chunked = dataclasses.replace(d.groups, chunk_bytes=48 if size <= 1000 else 4096)
    results[f"{size}_chunked"] = bool(torch.equal(flat, hierarchical_all_reduce(x.clone(), chunked)))
# a 2-D tensor (a bucket view of matrices) too
y = torch.arange(3 * 11, dtype=torch.float32).view(3, 11) * (env.rank + 1)
flat = y.clone()
dist.all_reduce(flat)
results["2d"] = bool(torch.equal(flat, hierarchical_all_reduce(y.clone(), d.groups)))
# the plan auto measures (on these groups, for a small and a larger bucket) and the algorithm it picks per size
plan = measure(d.groups, [4096, 65_536], torch.device("cpu"))
results["plan_agreed"] = comm.allgather(plan["sizes"]) == [plan["sizes"]] * env.world_size
for size in (1000, 12_345, 65_537):
    x = torch.randint(-1000, 1000, (size,), generator=torch.Generator().manual_seed(size + env.rank)).float()
    flat = x.clone()
    dist.all_reduce(flat)
    results[f"{size}_auto"] = bool(torch.equal(flat, ALGORITHMS[choose(plan, 4 * size)](x.clone(), d.groups)))
compressed = dataclasses.replace(d.groups, compress=True)
g = torch.Generator().manual_seed(7 + env.rank)
x = torch.randint(
    -40, 40, (12_345,), generator=g
).float()  # every partial and whole sum (<= 6 x 40) < 256: exact in bf16
flat = x.clone()
dist.all_reduce(flat)
results["bf16_small_integers"] = bool(torch.equal(flat, hierarchical_all_reduce(x.clone(), compressed)))
both = dataclasses.replace(compressed, chunk_bytes=4096)
results["bf16_chunked"] = bool(torch.equal(flat, hierarchical_all_reduce(x.clone(), both)))
z = torch.randn(4099, generator=g) / 3
flat = z.clone()
dist.all_reduce(flat)
low = hierarchical_all_reduce(z.clone(), compressed)
results["bf16_close"] = float((low - flat).abs().max()) <= 0.02 * (float(flat.abs().max()) + 1)
results["bf16_rounds_across_nodes"] = env.topology.num_nodes == 1 or not torch.equal(low, flat)
# Releasing the hierarchy's groups after start-up (HierGroups.release, when DDP's own all-reduce runs) ends their
# gloo threads (each wakes every 10 ms, used or not); the default group still works, and a released one fails
# naming itself instead of falling back to the default group.
del chunked, compressed, both  # copies that hold the groups
before = gloo_threads()
released = d.groups.release()
deadline = time.monotonic() + 5
while gloo_threads() > before - released and time.monotonic() < deadline:
    time.sleep(0.01)
results["released_own_groups"] = released == 1 + (env.topology.num_nodes > 1) + (env.topology.ranks_per_node > 1)
results["released_threads_ended"] = gloo_threads() == before - released
try:
    dist.all_reduce(torch.ones(1), group=d.groups.intra)
    results["released_group_refused"] = False
except (RuntimeError, ValueError) as exc:  # torch: "Process group <...> is not initialized ..."
    results["released_group_refused"] = "the intra process group, released after start-up" in str(exc)
ones = torch.ones(3)
dist.all_reduce(ones)
results["default_group_after_release"] = bool(torch.equal(ones, torch.full((3,), float(env.world_size))))
topo = [env.topology.num_nodes, env.topology.ranks_per_node]
out = Path(sys.argv[1]) / f"rank_{env.rank}.json"
out.write_text(json.dumps({"rank": env.rank, "topology": topo, "equal": results}))
shutdown(comm, clean=True)
sys.exit(0 if all(results.values()) else 1)
