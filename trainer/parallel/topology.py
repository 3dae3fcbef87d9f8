"""Topology as pure data: which rank is on which node, and which ranks form the intra- and inter-node groups.

The layout is a 2-D mesh of shape (nodes, ranks_per_node) in row-major rank order: rank r sits on node
``r // ranks_per_node`` at local index ``r % ranks_per_node``. Process groups (and a DeviceMesh) are built from
this in ``trainer.parallel.distributed``; nothing here needs a process group, so it is testable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import UserError

MESH_DIMS = ("node", "local")


@dataclass(frozen=True)
class Topology:
    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ranks_per_node < 1:
            raise UserError(
                f"impossible topology: world size {self.world_size} and {self.ranks_per_node} ranks per node "
                "must both be >= 1."
            )
        if self.world_size % self.ranks_per_node:
            raise UserError(
                f"impossible topology: world size {self.world_size} is not divisible by {self.ranks_per_node} "
                f"ranks per node (ranks {self.world_size - self.world_size % self.ranks_per_node}.."
                f"{self.world_size - 1} would form a partial node)."
            )

    @classmethod
    def from_node_ids(cls, node_ids: list[int]) -> Topology:
        """Topology from the node index of every rank (as gathered from MPI); nodes must be uniform and
        contiguous, since hierarchical collectives need equal-sized intra-node groups."""
        world = len(node_ids)
        counts: dict[int, list[int]] = {}
        for rank, node in enumerate(node_ids):
            counts.setdefault(node, []).append(rank)
        sizes = {node: len(ranks) for node, ranks in counts.items()}
        if len(set(sizes.values())) != 1:
            detail = ", ".join(f"node {n}: ranks {r}" for n, r in sorted(counts.items()))
            raise UserError(f"impossible topology: nodes hold different numbers of ranks ({detail}).")
        topo = cls(world, next(iter(sizes.values())))
        for ranks in counts.values():
            expected = topo.node_ranks(topo.node_of(ranks[0]))
            if ranks != expected:
                raise UserError(
                    f"impossible topology: ranks {ranks} share a node but are not contiguous in rank order "
                    f"(expected {expected}); start the ranks with a block distribution."
                )
        return topo

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (self.num_nodes, self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The ranks on one node: an intra-node group."""
        start = node * self.ranks_per_node
        return list(range(start, start + self.ranks_per_node))

    def intra_groups(self) -> list[list[int]]:
        """One group per node, in node order."""
        return [self.node_ranks(n) for n in range(self.num_nodes)]

    def inter_groups(self) -> list[list[int]]:
        """One group per local index: the ranks holding the same local index on every node."""
        return [list(range(i, self.world_size, self.ranks_per_node)) for i in range(self.ranks_per_node)]

    def mesh(self) -> list[list[int]]:
        """Rank layout as a (nodes, ranks_per_node) nested list, the layout of the node and local-index groups."""
        return self.intra_groups()

    def describe(self) -> dict:
        return {
            "world_size": self.world_size,
            "nodes": self.num_nodes,
            "ranks_per_node": self.ranks_per_node,
            "mesh_dims": list(MESH_DIMS),
        }

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
