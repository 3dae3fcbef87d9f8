"""Worker: hierarchical all-reduce == flat all-reduce exactly on integer-valued tensors of awkward sizes."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

from runconfig.schema import CommConfig
from trainer.env import from_mpi
from trainer.parallel.comm import hierarchical_all_reduce
from trainer.parallel.distributed import init_distributed, shutdown

comm = MPI.COMM_WORLD
env = from_mpi(comm)
d = init_distributed(env, CommConfig(timeout_s=60), torch.device("cpu"), comm)
results = {}
for size in [1, 2, 5, 7, 1000, 12_345, 65_537]:
    g = torch.Generator().manual_seed(1000 * size + env.rank)
    x = torch.randint(-1000, 1000, (size,), generator=g).float()
    flat = x.clone()
    dist.all_reduce(flat)
    hier = hierarchical_all_reduce(x.clone(), d.groups)
    results[size] = bool(torch.equal(flat, hier))
# a 2-D tensor (a bucket view of matrices) too
y = torch.arange(3 * 11, dtype=torch.float32).view(3, 11) * (env.rank + 1)
flat = y.clone()
dist.all_reduce(flat)
results["2d"] = bool(torch.equal(flat, hierarchical_all_reduce(y.clone(), d.groups)))
topo = [env.topology.num_nodes, env.topology.ranks_per_node]
out = Path(sys.argv[1]) / f"rank_{env.rank}.json"
out.write_text(json.dumps({"rank": env.rank, "topology": topo, "equal": results}))
shutdown(comm, clean=True)
sys.exit(0 if all(results.values()) else 1)
