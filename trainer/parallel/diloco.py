"""Rounds of local training between the nodes (comm.sync): DiLoCo and local SGD, for links that cannot keep up with
a gradient all-reduce every step.

Inside a node the ranks are one DDP replica (DDP over the node's group). Every ``comm.sync_every`` steps (a round,
H) and at the last step, the nodes meet: each replica's pseudo-gradient, the parameters at the last meeting minus
its own now, is averaged over the nodes (each rank of a node all-reduces its 1/ranks_per_node of it across nodes,
then the node all-gathers the pieces: each rank's link carries a share, as the hierarchical all-reduce does).
DiLoCo (Douillard et al., 2023) then puts the parameters back to the last meeting's and lets an outer SGD
(Nesterov momentum by default) step with the averaged pseudo-gradient as its gradient; local SGD takes the last
meeting's parameters minus the average, i.e. the mean of the replicas. Every rank ends a meeting with the same
parameters, so a checkpoint at a round's end holds one model; each node's inner optimizer state is its own.

Streaming (comm.sync_fragments > 1; Streaming DiLoCo, Douillard et al., 2025): the parameters are cut into
fragments that meet one at a time, staggered through the round, each every H steps, so the link carries a fragment
at a time. At a round's end only the last fragment has just met: a checkpoint there holds the fragments' last
meetings as the model (the same on every rank) and each node's own parameters under a key of its node.

torchft implements the same algorithm around its Manager (a lighthouse server, a store of its own, and recovery
from live peers). This package launches through MPI and Slurm and recovers from checkpoints, so the algorithm is
written here, on the run's own process groups, with its state in the run's checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from runconfig.schema.comm import CommConfig
from trainer.errors import UserError
from trainer.parallel.comm import HierGroups


class OuterSync:
    """The rounds of comm.sync=diloco or local_sgd for the bare ``model`` (names as the checkpoint's)."""

    def __init__(self, cfg: CommConfig, model: nn.Module, groups: HierGroups, local_rank: int) -> None:
        self.kind, self.every = cfg.sync, cfg.sync_every
        self.groups, self.local_rank = groups, local_rank
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in self.named]
        self.fragments = cut([p.numel() for p in params], cfg.sync_fragments)
        self.streaming = len(self.fragments) > 1
        # a fragment's step in the round (the last fragment's: the round's end, 0)
        self.offsets = [(f + 1) * self.every // len(self.fragments) % self.every for f in range(len(self.fragments))]
        # every name of each trained parameter, tied copies included (a checkpoint's model holds them all)
        index = {id(p): i for i, p in enumerate(params)}
        self.names = {n: index[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in index}
        self._local: dict | None = None  # a node's own parameters, loaded, applied by resume_local()
        # Floating-point buffers (a norm's running statistics) drift apart between meetings too: they are averaged
        # at each meeting, so a checkpoint at a round's end holds one value of each.
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        with torch.no_grad():  # every replica starts from global rank 0's parameters (DDP broadcasts per node only)
            for t in [*params, *model.buffers()]:
                dist.broadcast(t.data, src=0)
        self.originals = [p.detach().clone() for p in params]
        self.outer: torch.optim.SGD | None = None
        self.has_momentum = self.kind == "diloco" and cfg.outer_momentum > 0  # buffers to checkpoint
        if self.kind == "diloco":
            nesterov = cfg.outer_nesterov and cfg.outer_momentum > 0
            self.outer = torch.optim.SGD(params, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=nesterov)

    def at_round_end(self, step: int, last: bool) -> bool:
        """A round's end (every comm.sync_every steps and the last step): a checkpoint, a stop or a node's eviction
        may happen there."""
        return step % self.every == 0 or last

    def one_model(self, step: int, last: bool) -> bool:
        """Whether every replica holds the same parameters after this step's meeting (a replica check's steps)."""
        return last or (not self.streaming and step % self.every == 0)

    def meeting(self, step: int, last: bool) -> list[int]:
        """The fragments that meet after ``step``: all of them at the last step."""
        if last:
            return list(range(len(self.fragments)))
        return [f for f, offset in enumerate(self.offsets) if step % self.every == offset]

    @torch.no_grad()
    def sync(self, fragments: list[int] | None = None) -> None:
        """The meeting of the nodes for ``fragments`` (default: all), collective over every rank; the buffers
        meet with the last fragment, at the round's end."""
        fragments = list(range(len(self.fragments))) if fragments is None else fragments
        chosen = [i for f in fragments for i in self.fragments[f]]
        params = [self.named[i][1] for i in chosen]
        originals = [self.originals[i] for i in chosen]
        buffers = self.buffers if len(self.fragments) - 1 in fragments else []
        pairs = zip(originals, params, strict=True)
        parts = [o.float() - p.detach().float() for o, p in pairs] + [b.float() for b in buffers]
        averaged = self._average_over_nodes(torch.cat([t.reshape(-1) for t in parts]))
        offset = 0
        for p, original in zip(params, originals, strict=True):
            n = p.numel()
            g = averaged[offset : offset + n].view_as(p).to(p.dtype)
            offset += n
            p.copy_(original)
            if self.outer is None:
                p.sub_(g)  # local SGD: the mean of the replicas
            else:
                p.grad = g.clone()
        for b in buffers:
            b.copy_(averaged[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
        if self.outer is not None:
            self.outer.step()  # the parameters of other fragments have no gradient: untouched, momentum kept
            self.outer.zero_grad(set_to_none=True)
        for original, p in zip(originals, params, strict=True):
            original.copy_(p.detach())

    def _average_over_nodes(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean of ``flat`` over the nodes; every rank of every node gets the same bits."""
        g = self.groups
        if g.num_nodes == 1:
            return flat
        k = g.ranks_per_node
        if k == 1:
            dist.all_reduce(flat, group=g.inter)
            return flat.div_(g.num_nodes)
        size = -(-flat.numel() // k)
        padded = flat.new_zeros(size * k)  # on the parameters' device: NCCL groups take no CPU tensors
        padded[: flat.numel()] = flat
        pieces = list(padded.view(k, size).unbind(0))
        mine = pieces[self.local_rank].clone()
        dist.all_reduce(mine, group=g.inter)
        mine.div_(g.num_nodes)
        gathered = [torch.empty_like(mine) for _ in range(k)]
        dist.all_gather(gathered, mine, group=g.intra)
        return torch.cat(gathered)[: flat.numel()]

    # -- checkpoint ---------------------------------------------------------------------------------------------
    def checkpoint(self, model_state: dict, node: int) -> dict:
        """This rank's entries of a checkpoint beside the model's and the optimizer's: the outer momentum
        ("outer"), and when streaming this node's own parameters (``local_key(node)``), ``model_state``'s
        parameters then replaced by the fragments' last meetings, the same on every rank."""
        out = {"outer": self.state_dict()} if self.has_momentum else {}
        if self.streaming:
            for name, i in self.names.items():
                if name in model_state:
                    model_state[name] = self.originals[i]
            out[local_key(node)] = {n: p.detach() for n, p in self.named}
        return out

    def template(self, node: int, *, momentum: bool, local: bool) -> dict:
        """The entries ``checkpoint`` saved, for DCP to load into (``momentum``, ``local``: which were saved)."""
        out = {"outer": self.momentum_template()} if momentum and self.has_momentum else {}
        if local and self.streaming:
            out[local_key(node)] = {n: torch.empty_like(p) for n, p in self.named}
        return out

    def load(self, entries: dict, node: int) -> None:
        """Restore from the loaded ``template`` (the model already holds the checkpoint's model): the last meetings
        are the model's parameters, the outer momentum from its entry (none: before the first outer step), this
        node's own parameters kept for ``resume_local``."""
        self.load_state_dict(entries.get("outer", {}), has_momentum="outer" in entries)
        self._local = entries.get(local_key(node))

    @contextlib.contextmanager
    def consensus(self) -> Iterator[None]:
        """The fragments' last meetings in the parameters' place for the block (an evaluation then scores the model a
        checkpoint here holds, the same on every rank); each node's own parameters back after it."""
        own = [p.detach().clone() for _, p in self.named]
        with torch.no_grad():
            for original, (_, p) in zip(self.originals, self.named, strict=True):
                p.copy_(original)
        try:
            yield
        finally:
            with torch.no_grad():
                for mine, (_, p) in zip(own, self.named, strict=True):
                    p.copy_(mine)

    @torch.no_grad()
    def resume_local(self) -> None:
        """Put this node's own parameters, loaded by ``load``, in place (after the model's fingerprint is checked:
        it covers the last meetings); none loaded: every node goes on from the last meetings."""
        if self._local is not None:
            for n, p in self.named:
                p.copy_(self._local[n])
        self._local = None

    def state_dict(self) -> dict:
        """The outer optimizer's momentum by parameter name (the same on every rank; empty for local SGD or before
        the first outer step). A parameter whose fragment has not met since the momentum began (streaming, started
        inside a round) has a zero buffer: SGD's next step from it is the same as from none."""
        if not self.has_momentum:
            return {}
        bufs = {name: self.outer.state.get(p, {}).get("momentum_buffer") for name, p in self.named}
        if all(b is None for b in bufs.values()):
            return {}
        return {name: torch.zeros_like(p) if bufs[name] is None else bufs[name] for name, p in self.named}

    def momentum_template(self) -> dict:
        """What ``load_state_dict`` takes, for DCP to load into: a zero buffer per parameter."""
        if not self.has_momentum:
            return {}
        return {name: torch.zeros_like(p) for name, p in self.named}

    def load_state_dict(self, state: dict, *, has_momentum: bool) -> None:
        """Restore at a round's end: the last meeting's parameters are the loaded model's; the momentum buffers
        from ``state`` (none when the checkpoint was saved before the first outer step: ``has_momentum`` False)."""
        self._local = None  # an earlier attempt's, never applied
        with torch.no_grad():
            for original, (_, p) in zip(self.originals, self.named, strict=True):
                original.copy_(p.detach())
        if self.outer is None:
            return
        self.outer.state.clear()
        if has_momentum:
            for name, p in self.named:
                self.outer.state[p]["momentum_buffer"] = state[name].clone()


def local_key(node: int) -> str:
    """A checkpoint's key for node ``node``'s own parameters (streaming)."""
    return f"outer_node{node}"


def cut(sizes: list[int], parts: int) -> list[list[int]]:
    """Indices 0..len(sizes)-1 in ``parts`` contiguous runs of near-equal total size, none empty: a tensor goes to
    the next run when its middle lies past the current run's share."""
    if parts > len(sizes):
        raise UserError(
            f"comm.sync_fragments={parts}: the model has {len(sizes)} trained parameter tensors, and a fragment holds "
            "whole tensors; set comm.sync_fragments to at most that",
            collective=True,
        )
    total, out, acc, k = sum(sizes), [[] for _ in range(parts)], 0, 0
    for i, n in enumerate(sizes):
        if out[k] and k < parts - 1 and (acc + n / 2 > (k + 1) * total / parts or len(sizes) - i == parts - 1 - k):
            k += 1
        out[k].append(i)
        acc += n
    return out
