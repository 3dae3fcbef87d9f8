"""The parallel layout: how the world's ranks split into pipeline stages, data-parallel replicas, data-parallel
shards, context-parallel groups and tensor-parallel groups (the ``parallel:`` section resolved against a job's
shape). Torch-free: the login node refuses an impossible layout before any process starts, and the trainer builds
its DeviceMesh from it.

Placement follows the hardware. The mesh is ``(pp, dp_replicate, dp_shard, cp, tp)``, outermost to innermost, laid
over the global ranks in order, and the ranks of one node are consecutive (``rank = node x ranks_per_node +
local``). So a tensor-parallel group (innermost) lies inside a node when ``tp`` divides the ranks per node, the
context-parallel ranks (each holding a part of every sequence) and the data-parallel shards come next, and
pipeline stages and replicas span nodes. HSDP with ``dp_shard`` = the ranks of a node shards inside each node and
all-reduces across nodes once. The same order as torchtitan's ``ParallelDims``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Mesh dimensions, outermost first.
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class LayoutError(ValueError):
    """An impossible layout; ``key`` is the ``parallel.*`` key at fault."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each sees its own share of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """The ranks FSDP2 shards parameters over: the data-parallel shards times the context-parallel ranks (which
        hold the same parameters and need their gradients reduced), torchtitan's ``dp_shard_cp``."""
        return self.dp_shard * self.cp

    @property
    def sharded(self) -> bool:
        """Parameters are DTensors split over ranks: by FSDP2 (``dp_shard`` or ``cp`` > 1) or by tensor
        parallelism. Then the model's forward is collective, and the DeviceMesh path (not DDP) reduces the
        gradients."""
        return self.fsdp > 1 or self.tp > 1

    @property
    def uses_mesh(self) -> bool:
        """The DeviceMesh path (tensor parallelism, FSDP2, pipeline stages) rather than DDP: the model is sharded or
        staged, and its forward is collective (every rank must take part in each one, eval's included)."""
        return self.sharded or self.pp > 1

    @property
    def kind(self) -> str:
        """``ddp``, ``fsdp`` or ``hsdp`` (data parallelism), with ``+cp``/``+tp``/``+pp`` where those are on."""
        if self.fsdp > 1:
            name = "hsdp" if self.dp_replicate > 1 else "fsdp"
        else:
            name = "ddp"
        return name + ("+cp" if self.cp > 1 else "") + ("+tp" if self.tp > 1 else "") + ("+pp" if self.pp > 1 else "")

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIMS}

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (row-major over DIMS)."""
        out, rest = {}, rank
        for name in reversed(DIMS):
            out[name] = rest % getattr(self, name)
            rest //= getattr(self, name)
        return {name: out[name] for name in DIMS}

    def dp_rank(self, rank: int) -> int:
        """Index of ``rank`` among the data-parallel ranks (replica-major): its share of the data."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self) -> str:
        return " x ".join(f"{name} {size}" for name, size in self.sizes().items())


def degree_problem(value: int) -> str | None:
    """Why ``value`` cannot be a parallel degree (None when it can): at least 1, or -1 for what the others leave."""
    if value != -1 and value < 1:
        return f"must be >= 1, or -1 for what the other degrees leave; got {value}"
    return None


def resolve(degrees: dict[str, int], world_size: int, ranks_per_node: int) -> Layout:
    """The layout for ``degrees`` (``parallel.*``, -1 on at most one: what the others leave) on ``world_size`` ranks
    of ``ranks_per_node`` per node (a degree not given is 1). Raises LayoutError naming the key at fault."""
    degrees = {name: degrees.get(name, 1) for name in DIMS}
    wild = [name for name in DIMS if degrees[name] == -1]
    for name in DIMS:
        if problem := degree_problem(degrees[name]):
            raise LayoutError(name, problem)
    if len(wild) > 1:
        raise LayoutError(wild[1], f"only one degree may be -1 (what the others leave); {' and '.join(wild)} are")
    tp = degrees["tp"]
    if tp > 1 and ranks_per_node % tp:  # before the product: tp=3 on 2-rank nodes is tp's fault, not the remainder's
        raise LayoutError(
            "tp",
            f"{tp} does not divide the {ranks_per_node} ranks of a node: a tensor-parallel group must lie "
            "inside one node (its collectives run in every layer)",
        )
    fixed = 1
    for name in DIMS:
        if name not in wild:
            fixed *= degrees[name]
    if wild:
        if world_size % fixed:
            raise LayoutError(
                _set_at_fault(degrees, world_size),
                f"-1 takes what is left of the {world_size} ranks, but the other degrees multiply to {fixed}, "
                f"which does not divide {world_size}",
            )
        degrees = {**degrees, wild[0]: world_size // fixed}
    layout = Layout(**{name: degrees[name] for name in DIMS})
    if layout.world_size != world_size:
        raise LayoutError(
            _set_at_fault(degrees, world_size),
            f"{layout.describe()} = {layout.world_size} ranks, but the job has {world_size}; the product of the "
            "degrees must be the world size (set one degree to -1 to take what is left)",
        )
    if layout.tp > 1 and ranks_per_node % layout.tp:  # tp was -1: what was left does not fit a node
        raise LayoutError(
            "tp",
            f"{layout.tp} does not divide the {ranks_per_node} ranks of a node: a tensor-parallel group must lie "
            "inside one node (its collectives run in every layer)",
        )
    return layout


def _set_at_fault(degrees: dict[str, int], world_size: int) -> str:
    """The degree to name when the degrees do not multiply to the world size: one the user set (not -1, not 1)
    that does not divide the world, else the innermost one set; dp_replicate when none is."""
    given = [name for name in DIMS if degrees[name] not in (-1, 1)]
    misfits = [name for name in given if world_size % degrees[name]]
    if misfits:
        return misfits[0]
    return given[-1] if given else "dp_replicate"
