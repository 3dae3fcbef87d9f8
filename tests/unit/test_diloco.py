"""trainer/parallel/diloco.py's meetings on a real gloo world of 2 nodes x 2 ranks (4 processes): the replicas'
parameters after each meeting against DiLoCo's outer Nesterov step and local SGD's mean, computed here by hand
from the same numbers; every rank ends a meeting with the same bits; the outer state survives a save and a load."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from runconfig.schema.comm import CommConfig
from trainer.parallel.comm import HierGroups
from trainer.parallel.diloco import OuterSync

NODES, PER_NODE = 2, 2
LR, MOMENTUM = 0.7, 0.9


def drift(node: int, round_: int) -> float:
    """How far node ``node``'s replica moves in round ``round_`` (the same on the node's ranks: DDP inside it)."""
    return 0.1 * (node + 1) + 0.05 * round_


def worker(rank: int, store: str, kind: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=NODES * PER_NODE)
    intra = [dist.new_group([n * PER_NODE + i for i in range(PER_NODE)]) for n in range(NODES)]
    inter = [dist.new_group([n * PER_NODE + i for n in range(NODES)]) for i in range(PER_NODE)]
    node, local = divmod(rank, PER_NODE)
    groups = HierGroups(intra=intra[node], inter=inter[local], ranks_per_node=PER_NODE, num_nodes=NODES)
    torch.manual_seed(100 + rank)  # every rank starts elsewhere: the meeting's broadcast makes them rank 0's
    model = nn.Linear(5, 3)
    cfg = CommConfig(sync=kind, sync_every=4, outer_lr=LR, outer_momentum=MOMENTUM)
    outer = OuterSync(cfg, model, groups, local)
    start = [p.detach().clone() for p in model.parameters()]
    seen = []
    for round_ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(drift(node, round_))
        outer.sync()
        seen.append([p.detach().clone() for p in model.parameters()])
        if round_ == 1:  # a checkpoint here: the outer state out and into a fresh OuterSync on the same model
            saved = {k: v.clone() for k, v in outer.state_dict().items()}
            outer = OuterSync(cfg, model, groups, local)
            template = outer.template()
            for k in template:
                template[k].copy_(saved[k])
            outer.load_state_dict(template, has_momentum=bool(template))
    result = {"start": [t.tolist() for t in start], "seen": [[t.tolist() for t in r] for r in seen]}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["diloco", "local_sgd"])
def test_meetings_match_the_outer_step_computed_by_hand(tmp_path, kind):
    out = str(tmp_path / "out")
    mp.start_processes(worker, args=(str(tmp_path / "store"), kind, out), nprocs=NODES * PER_NODE,
                       start_method="fork" if sys.platform == "linux" else "spawn")  # fmt: skip
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(NODES * PER_NODE)]
    assert all(r["seen"] == results[0]["seen"] for r in results)  # the same bits on every rank after each meeting
    params = [torch.tensor(t) for t in results[0]["start"]]  # rank 0's: broadcast to all at the start
    buf = None
    for round_, seen in enumerate(results[0]["seen"]):
        # each node drifted by +drift: the pseudo-gradient (original - replica) is -drift, averaged over the nodes
        g = -sum(drift(n, round_) for n in range(NODES)) / NODES
        if kind == "local_sgd":
            params = [p - g for p in params]
        else:
            grad = [torch.full_like(p, g) for p in params]
            buf = grad if buf is None else [MOMENTUM * b + d for b, d in zip(buf, grad, strict=True)]
            step = [d + MOMENTUM * b for d, b in zip(grad, buf, strict=True)]  # Nesterov
            params = [p - LR * s for p, s in zip(params, step, strict=True)]
        for want, got in zip(params, seen, strict=True):
            assert torch.allclose(torch.tensor(got), want, atol=1e-6), (kind, round_)
