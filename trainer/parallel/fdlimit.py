"""Open files a rank needs at its world size, and its soft limit raised to the hard one at start (torch-free).

Slurm hands a job the submitting shell's limits (often 1,024 open files soft), and a rank holds connections that
grow with the world: rank 0 serves a rendezvous-store client per rank and two per node (``store_clients``), and gloo
connects every pair of ranks in a group when the group is made (about one socket per peer and group, measured with
torch 2.13).
"""

from __future__ import annotations

import resource

BASE_FILES = 1024  # a rank's own: logs, data shards, checkpoint files, the MPI library's and the tracker's
# Each rank's clients of rank 0's store: the process group's, and the heartbeat thread's and the roll call's of a
# node's first rank for its node (trainer/observe/noderelay.py), of each rank where a node has one rank.
STORE_CONNECTIONS = 3
RELAY_MARGIN = 64  # ranks whose node's relay failed (each holds its own two), before the hard limit is short
# Groups over every rank that gloo connects in full: the default group, the flat all-reduce's and the checkpoint
# agreement's; with NCCL only the last (trainer/checkpoint/checkpointer.py) is gloo's.
GLOO_WORLD_GROUPS = {True: 3, False: 1}
CEILING = 1 << 20  # what "unlimited" is raised to (select-free code; close_range makes a high limit cheap)


def store_clients(world_size: int, ranks_per_node: int) -> int:
    """Clients of rank 0's store at ``world_size``: one a rank and two a node (three a rank where a node holds one
    rank: no relay)."""
    if ranks_per_node <= 1:
        return STORE_CONNECTIONS * world_size
    return world_size + 2 * (-(-world_size // ranks_per_node) + RELAY_MARGIN)


def needed(rank: int, world_size: int, *, gloo: bool, ranks_per_node: int = 1) -> int:
    """Open files this rank needs at ``world_size``, an estimate with margin."""
    store = store_clients(world_size, ranks_per_node) if rank == 0 else 0
    return BASE_FILES + store + GLOO_WORLD_GROUPS[gloo] * world_size


def raise_open_files(
    rank: int, world_size: int, host: str, *, gloo: bool, ranks_per_node: int = 1
) -> tuple[int, int, str | None]:
    """Raise this process' soft limit on open files to its hard limit; (soft before, soft now, error) where the
    error says the hard limit is below what this rank needs at this world size (None when it is not)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = CEILING if hard == resource.RLIM_INFINITY else hard
    now = soft
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        now = target
    want = needed(rank, world_size, gloo=gloo, ranks_per_node=ranks_per_node)
    if now != resource.RLIM_INFINITY and now < want:
        how = "one a rank, two a node" if ranks_per_node > 1 else f"{STORE_CONNECTIONS} a rank"
        clients = f"{store_clients(world_size, ranks_per_node)} rendezvous-store connections ({how})"
        role = f"rank 0 serves {clients}, and " if rank == 0 else ""
        error = (
            f"rank {rank} on {host} may open {now} files (RLIMIT_NOFILE hard limit, `ulimit -Hn`) but needs about "
            f"{want} at {world_size} ranks: {role}{'gloo' if gloo else 'the checkpoint agreement'} connects every "
            f"pair of ranks. Ask for a higher hard limit on the nodes (limits.conf or Slurm's "
            f"PropagateResourceLimits), or run fewer ranks."
        )
        return soft, now, error
    return soft, now, None
