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
from trainer.errors import UserError
from trainer.parallel.comm import HierGroups
from trainer.parallel.diloco import OuterSync, cut

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
            template = outer.momentum_template()
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


def test_fragments_are_contiguous_near_equal_and_never_empty():
    assert cut([15, 3, 6, 2], 2) == [[0], [1, 2, 3]]
    assert cut([4] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cut([100, 1, 1], 3) == [[0], [1], [2]]  # the small ones still get a fragment each
    assert cut([1, 1, 100], 2) == [[0, 1], [2]]
    assert cut([5], 1) == [[0]]
    with pytest.raises(UserError, match="comm.sync_fragments=3: the model has 2 trained parameter tensors"):
        cut([5, 5], 3)


STREAM_STEPS, STREAM_EVERY = 9, 4  # the last step, 9, is no round's end: every fragment meets there


def stream_drift(node: int, step: int, index: int) -> float:
    return 0.01 * (node + 1) * step + 0.003 * index


def streaming_worker(rank: int, store: str, out: str) -> None:
    """Streaming DiLoCo with 2 fragments over 9 steps, once straight through and once saved at the round's end
    (step 4) into a fresh model and OuterSync (the checkpoint's entries as DCP would hand them back)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=NODES * PER_NODE)
    intra = [dist.new_group([n * PER_NODE + i for i in range(PER_NODE)]) for n in range(NODES)]
    inter = [dist.new_group([n * PER_NODE + i for n in range(NODES)]) for i in range(PER_NODE)]
    node, local = divmod(rank, PER_NODE)
    groups = HierGroups(intra=intra[node], inter=inter[local], ranks_per_node=PER_NODE, num_nodes=NODES)
    cfg = CommConfig(sync="diloco", sync_every=STREAM_EVERY, sync_fragments=2, outer_lr=LR, outer_momentum=MOMENTUM)
    result = {}
    for label in ("straight", "saved"):
        torch.manual_seed(7)
        model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
        outer = OuterSync(cfg, model, groups, local)
        result.setdefault("start", [p.tolist() for p in model.parameters()])
        seen, met = [], []
        for step in range(1, STREAM_STEPS + 1):
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    p.add_(stream_drift(node, step, i))
            fragments = outer.meeting(step, step == STREAM_STEPS)
            met.append(fragments)
            if fragments:
                outer.sync(fragments)
            seen.append([p.tolist() for p in model.parameters()])
            if label == "straight" and step == 3:  # fragment 0 met at 2, fragment 1 not yet
                momentum = outer.state_dict()
                result["zero_momentum"] = [n for n, t in momentum.items() if not t.any()]
                with outer.consensus():
                    result["consensus"] = [p.tolist() for p in model.parameters()]
                assert [p.tolist() for p in model.parameters()] == seen[-1]  # each node's own back
            if label == "saved" and step == STREAM_EVERY:
                msd = dict(model.state_dict())
                entries = outer.checkpoint(msd, node)
                result["saved_model"] = {k: v.tolist() for k, v in msd.items()}
                saved = {k: {n: t.clone() for n, t in v.items()} for k, v in entries.items()}
                model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))  # another start, overwritten by the load
                model.load_state_dict({k: torch.tensor(v) for k, v in result["saved_model"].items()})
                outer = OuterSync(cfg, model, groups, local)
                template = outer.template(node, momentum=True, local=True)
                assert set(template) == set(saved) == {"outer", f"outer_node{node}"}
                for key, tensors in template.items():
                    for n, t in tensors.items():
                        t.copy_(saved[key][n])
                outer.load(template, node)
                outer.resume_local()
        result[label], result["met"] = seen, met
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_streaming_fragments_meet_staggered_and_resume_from_a_rounds_end_bitwise(tmp_path):
    out = str(tmp_path / "out")
    mp.start_processes(streaming_worker, args=(str(tmp_path / "store"), out), nprocs=NODES * PER_NODE,
                       start_method="fork" if sys.platform == "linux" else "spawn")  # fmt: skip
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(NODES * PER_NODE)]
    # fragment 0 (the first layer's weight) meets at the round's middle, fragment 1 (the rest) at its end
    assert results[0]["met"] == [[], [0], [], [1], [], [0], [], [1], [0, 1]]
    for r in results:
        assert r["saved"] == r["straight"]  # the save and load at step 4 changed no bit
        assert r["saved_model"] == results[0]["saved_model"]  # the checkpoint's model: one, the last meetings
    for node in range(NODES):  # a node's ranks agree (DDP inside it); the nodes differ between meetings
        assert results[node * PER_NODE]["straight"] == results[node * PER_NODE + 1]["straight"]
    assert results[0]["straight"][2] != results[PER_NODE]["straight"][2]
    assert results[0]["straight"][-1] == results[PER_NODE]["straight"][-1]  # all met at the last step
    # inside the first round: a buffer for each name, zero where the fragment has not met (a checkpoint loads them)
    assert results[0]["zero_momentum"] == ["0.bias", "1.weight", "1.bias"]
    # the consensus (an evaluation's model) is the same on every rank, while the nodes' own differ
    assert all(r["consensus"] == results[0]["consensus"] for r in results)

    # by hand: each tensor's last meeting, each node's replica and the outer momentum
    start = [torch.tensor(t) for t in results[0]["start"]]
    fragment_of = [0, 1, 1, 1]
    meets = {2: {0}, 4: {1}, 6: {0}, 8: {1}, 9: {0, 1}}
    globals_ = [t.clone() for t in start]
    replicas = [[t.clone() for t in start] for _ in range(NODES)]
    buf: list = [None] * len(start)
    for step in range(1, STREAM_STEPS + 1):
        for n in range(NODES):
            replicas[n] = [x + stream_drift(n, step, i) for i, x in enumerate(replicas[n])]
        for i, f in enumerate(fragment_of):
            if f in meets.get(step, ()):
                g = sum(globals_[i] - replicas[n][i] for n in range(NODES)) / NODES
                buf[i] = g if buf[i] is None else MOMENTUM * buf[i] + g
                globals_[i] = globals_[i] - LR * (g + MOMENTUM * buf[i])
                for n in range(NODES):
                    replicas[n][i] = globals_[i].clone()
        for n in range(NODES):
            got = results[n * PER_NODE]["straight"][step - 1]
            for want, have in zip(replicas[n], got, strict=True):
                assert torch.allclose(torch.tensor(have), want, atol=1e-5), (step, n)
        if step == 3:  # the last meetings: fragment 0's at step 2, fragment 1's none (the start)
            for want, have in zip(globals_, results[0]["consensus"], strict=True):
                assert torch.allclose(torch.tensor(have), want, atol=1e-6)
        if step == STREAM_EVERY:
            saved = results[0]["saved_model"]
            for name, want in zip(["0.weight", "0.bias", "1.weight", "1.bias"], globals_, strict=True):
                assert torch.allclose(torch.tensor(saved[name]), want, atol=1e-6)
