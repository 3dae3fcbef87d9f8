"""``params_sha256``: one hash of the model parameters, to compare runs bit for bit, whatever their layout.

Format 3 (checkpoint manifests and summary.json since the parallel layouts): each parameter's digest is
SHA-256 over ``name|dtype|shape\\n`` and its raw bytes, computed by ONE owner rank from the whole tensor; the
fingerprint is SHA-256 over the ``name digest`` lines in name order. The owners split the parameters by size, so
each rank hashes ~1/N of the model, and a sharded parameter (FSDP2's DTensor, sharded on dim 0) is gathered to its
owner alone: no rank does work proportional to the whole model. The result does not depend on how the parameters
are split (a run resharded between launches can still be compared), nor on which rank owns what.

``params_sha256_v1``: the earlier definition (one SHA-256 over every parameter's bytes in name order), for
manifests of formats 1-2 and for pins taken with it.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch import nn


def _header(name: str, t: torch.Tensor) -> bytes:
    return f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode()


def _update(h, t: torch.Tensor) -> None:
    t = t.detach().to("cpu").contiguous()
    if t.numel():
        h.update(memoryview(t.view(torch.uint8).numpy()))


def params_sha256_v1(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The format-1/2 hash over (name, tensor) pairs, every tensor whole on this rank (DTensors are gathered)."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, p in sorted(named, key=lambda item: item[0]):
        t = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(_header(name, t))
        _update(h, t)
    return h.hexdigest()


def owners(sizes: list[int], world: int) -> list[int]:
    """Owner rank of each entry when every rank holds every entry: ``owners_among``'s rule (largest first to the
    least-loaded rank, ties to the lowest). Deterministic."""
    entries = list(range(len(sizes)))
    who = owners_among(entries, dict(enumerate(sizes)), dict.fromkeys(entries, list(range(world))))
    return [who[i] for i in entries]


def param_digest(name: str, t: torch.Tensor) -> str:
    h = hashlib.sha256(_header(name, t))
    _update(h, t)
    return h.hexdigest()


def combine(digests: dict[str, str]) -> str:
    """The fingerprint of per-parameter digests: SHA-256 over ``name digest`` lines in name order."""
    return hashlib.sha256("".join(f"{n} {digests[n]}\n" for n in sorted(digests)).encode()).hexdigest()


def params_sha256(model: nn.Module, group: dist.ProcessGroup | None = None, *, skip: Collection[str] = ()) -> str:
    """The format-3 fingerprint of the model's parameters (tied ones once; ``skip``: names of tied copies held
    apart, a pipeline's). Collective over every rank when a process group exists (``group``: the one the
    digests are gathered on; default: the world)."""
    return tensors_sha256(((n, p) for n, p in model.named_parameters() if n not in skip), group)


def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None = None) -> str:
    """The same over (name, tensor) pairs: plain tensors (whole on every rank that has them, as under DDP: the
    owner hashes its own copy) or DTensors (gathered to the owner). Ranks may hold different names (pipeline
    stages): the owner of each is one of the ranks that hold it; ranks that hold the same names (a stage's, with
    their DTensors' meshes) pass them in the same order."""
    items = sorted(named, key=lambda item: item[0])
    if not dist.is_initialized():
        return combine({name: param_digest(name, t) for name, t in items})
    rank = dist.get_rank()
    holders, sizes = _holders([(name, t.numel()) for name, t in items], group)
    who = owners_among(sorted(sizes), sizes, holders)
    mine = {}
    for name, t in items:
        whole = _whole_on(t, who[name], rank)
        if rank == who[name]:
            mine[name] = param_digest(name, whole)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return combine({k: v for part in gathered for k, v in part.items()})


def _holders(mine: list[tuple[str, int]], group: dist.ProcessGroup | None) -> tuple[dict, dict]:
    """({name: the ranks that hold it}, {name: numel}) over the group: every rank gathers a digest of its (name,
    numel) list, and one rank of each distinct list broadcasts it (a list per pipeline stage, not per rank: the
    lists themselves, gathered, were 23 MB on every rank at 4,096 ranks). Names of one list share one holders
    list."""
    key = hashlib.sha256(repr(mine).encode()).hexdigest()
    keys: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, key, group=group)
    members: dict[str, list[int]] = {}
    for r, k in enumerate(keys):
        members.setdefault(k, []).append(dist.get_global_rank(group, r) if group is not None else r)
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for k, ranks in members.items():
        box = [mine if k == key else None]
        dist.broadcast_object_list(box, src=ranks[0], group=group)
        for name, numel in box[0]:
            holders[name] = holders[name] + ranks if name in holders else ranks
            sizes[name] = numel
    return holders, sizes


def owners_among(names: list, sizes: dict, holders: dict[object, list[int]]) -> dict:
    """Owner rank of each name among the ranks that hold it: largest first to the least-loaded holder (ties:
    lowest rank). The one owner rule: ``owners`` is its case where every rank holds every name. A heap of (load,
    rank) per holders list (names that share one list share its heap; loads only grow, so an entry found stale at
    the top is pushed back with its rank's load): O(names x log ranks), where a scan of the holders cost 3.8 s at
    4,096 ranks' restore."""
    load: dict[int, int] = {}
    heaps: dict[int, tuple[list[int], list[tuple[int, int]]]] = {}  # id(holders list) -> (the list, its heap)
    out = {}
    order = {n: i for i, n in enumerate(names)}
    for name in sorted(names, key=lambda n: (-sizes[n], order[n])):
        group = holders[name]
        if id(group) not in heaps:
            heaps[id(group)] = (group, sorted((load.get(r, 0), r) for r in set(group)))  # sorted: a heap
        heap = heaps[id(group)][1]
        while heap[0][0] != load.get(heap[0][1], 0):  # stale: its rank took a name through another list since
            heapq.heapreplace(heap, (load.get(heap[0][1], 0), heap[0][1]))
        r = heap[0][1]
        out[name] = r
        load[r] = load.get(r, 0) + sizes[name]
        heapq.heapreplace(heap, (load[r], r))
    return out


def _whole_on(t: torch.Tensor, owner: int, rank: int) -> torch.Tensor | None:
    """The whole tensor on rank ``owner`` (None elsewhere). A DTensor sharded on dim 0 of one mesh dimension (FSDP2,
    replicated on the others: HSDP; tensor parallelism's column split) is gathered over the owner's shard group
    only; other placements (a row split, TP x FSDP's 2-D) fall back to ``full_tensor()`` on every rank of the
    owner's mesh."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return t if rank == owner else None
    if owner not in t.device_mesh.mesh:
        # A mesh of part of the world (tensor parallelism's group): the other groups hold copies of the same
        # tensor, and the owner's own group gathers it.
        return None
    placements = list(t.placements)
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    simple = len(sharded) == 1 and placements[sharded[0]] == Shard(0)
    simple = simple and all(isinstance(p, Replicate) for i, p in enumerate(placements) if i != sharded[0])
    if not simple:
        whole = t.full_tensor()
        return whole if rank == owner else None
    mesh, dim = t.device_mesh, sharded[0]
    # The shard group that holds the owner: the ranks that share its coordinates on every other mesh dimension.
    groups = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.shape[dim])
    row = next(g for g in groups.tolist() if owner in g)
    if rank not in row:
        return None
    group = mesh.get_group(dim)
    n = len(row)
    rows = t.shape[0]
    per = -(-rows // n)  # FSDP2's chunking: ceil(rows / n) each, the last ones shorter or empty
    local = t.to_local()
    padded = torch.zeros((per, *t.shape[1:]), dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in range(n)] if rank == owner else None
    dist.gather(padded, pieces, dst=owner, group=group)
    return torch.cat(pieces)[:rows] if rank == owner else None
