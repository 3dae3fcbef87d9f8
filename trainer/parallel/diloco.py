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

torchft implements the same algorithm around its Manager (a lighthouse server, a store of its own, and recovery
from live peers). This package launches through MPI and Slurm and recovers from checkpoints, so the algorithm is
written here, on the run's own process groups, with its state in the run's checkpoints.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from runconfig.schema.comm import CommConfig
from trainer.parallel.comm import HierGroups


class OuterSync:
    """The rounds of comm.sync=diloco or local_sgd for the bare ``model`` (names as the checkpoint's)."""

    def __init__(self, cfg: CommConfig, model: nn.Module, groups: HierGroups, local_rank: int) -> None:
        self.kind, self.every = cfg.sync, cfg.sync_every
        self.groups, self.local_rank = groups, local_rank
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in self.named]
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
        """Where the nodes meet (every comm.sync_every steps and at the last step), after which every replica holds
        the same parameters: a checkpoint, a stop or a node's eviction may happen there."""
        return step % self.every == 0 or last

    @torch.no_grad()
    def sync(self) -> None:
        """The meeting of the nodes (collective over every rank)."""
        params = [p for _, p in self.named]
        pairs = zip(self.originals, params, strict=True)
        parts = [o.float() - p.detach().float() for o, p in pairs] + [b.float() for b in self.buffers]
        averaged = self._average_over_nodes(torch.cat([t.reshape(-1) for t in parts]))
        offset = 0
        for p, original in zip(params, self.originals, strict=True):
            n = p.numel()
            g = averaged[offset : offset + n].view_as(p).to(p.dtype)
            offset += n
            p.copy_(original)
            if self.outer is None:
                p.sub_(g)  # local SGD: the mean of the replicas
            else:
                p.grad = g.clone()
        for b in self.buffers:
            b.copy_(averaged[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
        if self.outer is not None:
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
        for original, p in zip(self.originals, params, strict=True):
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
    def state_dict(self) -> dict:
        """The outer optimizer's momentum by parameter name (the same on every rank; empty for local SGD or before
        the first outer step). The last meeting's parameters are the model's own at a round's end."""
        if not self.has_momentum:
            return {}
        out = {}
        for name, p in self.named:
            buf = self.outer.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                out[name] = buf
        return out

    def template(self) -> dict:
        """What ``load_state_dict`` takes, for DCP to load into: a zero buffer per parameter."""
        if not self.has_momentum:
            return {}
        return {name: torch.zeros_like(p) for name, p in self.named}

    def load_state_dict(self, state: dict, *, has_momentum: bool) -> None:
        """Restore at a round's end: the last meeting's parameters are the loaded model's; the momentum buffers
        from ``state`` (none when the checkpoint was saved before the first outer step: ``has_momentum`` False)."""
        with torch.no_grad():
            for original, (_, p) in zip(self.originals, self.named, strict=True):
                original.copy_(p.detach())
        if self.outer is None:
            return
        self.outer.state.clear()
        if has_momentum:
            for name, p in self.named:
                self.outer.state[p]["momentum_buffer"] = state[name].clone()
