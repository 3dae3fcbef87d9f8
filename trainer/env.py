"""The one place that reads the process environment: MPI ranks, host layout and scheduler variables.

Everything else receives the frozen ``RuntimeEnv`` built here; nothing in the loop reads ``os.environ``.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TypeVar

from mpi4py import MPI

from rundir.contract import (
    INJECT_VAR,
    KEEPER_VAR,
    LAUNCH_VAR,
    NODE_LABELS_VAR,
    SIMULATE_VAR,
    SPAWN_RANK_VAR,
    SPAWN_WORLD_VAR,
    STORE_KEY_VAR,
    data_cache,
)
from rundir.slurmvars import PROCID_VAR, slurm_job_id, slurm_restart_count
from tracking import MLFLOW_URI_VAR, TRACKING_VAR
from trainer.errors import UserError
from trainer.observe import inject
from trainer.observe.inject import Fault
from trainer.parallel.keeper import KeeperAddress
from trainer.parallel.topology import Topology

T = TypeVar("T")


@dataclass(frozen=True)
class RuntimeEnv:
    rank: int
    world_size: int
    host_local_rank: int  # index among the ranks on this physical host (picks the GPU)
    host_local_size: int
    hostname: str
    slurm_node: str | None  # SLURMD_NODENAME inside a Slurm step
    hosts: tuple[str, ...]  # host name of every rank
    # Every rank on one host and in one network namespace: every link between (simulated) nodes is loopback. Nodes
    # emulated with a network namespace each (bench/common.py's shaped link) are not.
    one_network: bool
    node_names: tuple[str, ...]  # node of every rank as the launcher names it: SLURMD_NODENAME, else the host name
    topology: Topology
    simulated_nodes: bool
    cpus: int  # CPUs this process may run on
    slurm_job_id: str | None
    slurm_restart_count: int | None
    data_cache: Path  # where datasets prepared on first use are kept ($HPC_DATA_CACHE)
    launch_id: str = ""  # the launcher's id for this start of the ranks ($HPC_LAUNCH_ID), in history events
    inject: tuple[Fault, ...] = ()  # faults injected on purpose by tests ($HPC_INJECT, trainer/observe/inject.py)
    tracking_vars: tuple[tuple[str, str], ...] = ()  # HPC_TRACKING, MLFLOW_TRACKING_URI (tracking/)
    keeper: KeeperAddress | None = None  # job.spare_ranks: the launch's keeper ($HPC_KEEPER)
    store_key: bytes = field(default=b"", repr=False, compare=False)  # its store's key ($HPC_STORE_KEY, then dropped)

    @property
    def node(self) -> int:
        return self.topology.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.topology.local_rank(self.rank)

    @property
    def single_host(self) -> bool:
        return len(set(self.hosts)) == 1

    def suspect(self, rank: int, why: str) -> dict:
        """A rank a failure points at, for failure.json: its node's name and index (the launcher leaves that node
        out of the next launch; with simulated nodes the index is all that tells them apart)."""
        return {"rank": rank, "node": self.node_names[rank], "node_index": self.topology.node_of(rank), "why": why}

    def default_threads(self) -> int:
        return max(1, self.cpus // self.host_local_size)

    #: the fields a rank started without MPI takes from the launch's layout (``spawned_layout``; the rest are its own
    #: process's)
    SHARED = ("world_size", "hosts", "one_network", "node_names", "simulated_nodes", "launch_id")

    def as_rank(self, rank: int, record: dict) -> RuntimeEnv:
        """This process's environment in ``rank``'s place (``record``: ``spawned_layout``'s)."""
        own = {f.name: getattr(self, f.name) for f in fields(self)}
        shared = {name: record[name] for name in self.SHARED}
        shared["hosts"], shared["node_names"] = tuple(shared["hosts"]), tuple(shared["node_names"])
        local_rank, local_size = record["host_local"][rank]
        topology = Topology.from_node_ids(record["node_ids"])
        place = {"rank": rank, "host_local_rank": local_rank, "host_local_size": local_size, "topology": topology}
        return RuntimeEnv(**{**own, **shared, **place})


def _network_namespace() -> str:
    """This process's network namespace ("net:[INODE]"; "" where /proc does not tell)."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def from_mpi(comm: MPI.Comm = MPI.COMM_WORLD, environ: dict[str, str] | None = None) -> RuntimeEnv:
    """Read ranks and the host layout from MPI (collective: every rank must call it)."""
    environ = dict(os.environ if environ is None else environ)
    rank, size = comm.Get_rank(), comm.Get_size()
    hostname = socket.gethostname()
    # The first meeting after the imports, which end seconds apart.
    seen = patient_allgather(comm, (hostname, _network_namespace()))
    hosts = tuple(name for name, _ in seen)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    host_local_rank, host_local_size = local.Get_rank(), local.Get_size()
    leader = local.bcast(rank, root=0)  # world rank of the first rank on this host
    local.Free()

    _check_slurm_world(environ, size, hostname)
    simulate = environ.get(SIMULATE_VAR, "").strip()
    topology = _topology(comm, environ, simulate, size, leader)
    node_names = _node_names(comm, environ, simulate, topology, size, hostname)
    return replace(own_env(environ), rank=rank, world_size=size, host_local_rank=host_local_rank,
                   host_local_size=host_local_size, hosts=hosts, one_network=len(set(seen)) == 1,
                   node_names=node_names, topology=topology, simulated_nodes=bool(simulate))  # fmt: skip


def from_spawn(environ: dict[str, str] | None = None) -> RuntimeEnv:
    """A rank started without MPI (job.spare_ranks): by the local launcher (hpc/spawn.py: $HPC_SPAWN_RANK) or by
    srun with no MPI plugin ($SLURM_PROCID), the world in $HPC_SPAWN_WORLD. The launch's layout is left as one rank
    alone: the ranks meet in the keeper's store for it (``where`` from each, ``spawned_layout`` by rank 0, then
    ``as_rank``), as a spare does."""
    environ = dict(os.environ if environ is None else environ)
    try:
        rank, size = int(_spawned_rank_text(environ)), int(environ[SPAWN_WORLD_VAR])
    except (KeyError, ValueError):
        raise UserError(f"environment variables {SPAWN_RANK_VAR} (or Slurm's {PROCID_VAR}) and {SPAWN_WORLD_VAR} "
                        "must be integers: the launcher sets them") from None  # fmt: skip
    if not 0 <= rank < size:
        raise UserError(f"rank {rank} is outside the launch's world of {size} ({SPAWN_WORLD_VAR}): the launcher's "
                        "task count and job.nodes x job.ranks_per_node differ")  # fmt: skip
    return replace(own_env(environ), rank=rank, world_size=size)


def _spawned_rank_text(environ: dict[str, str]) -> str:
    return environ.get(SPAWN_RANK_VAR, environ.get(PROCID_VAR, ""))


def spawned_rank(environ: dict[str, str]) -> int:
    """A spawned rank's number before its environment is read whole (what a failure is reported under); -1 where
    the launcher set none."""
    text = _spawned_rank_text(environ)
    return int(text) if text.isdigit() else -1


def where(environ: dict[str, str] | None = None) -> dict:
    """This process's place, for the spawned ranks' meeting: its host, network namespace and Slurm node."""
    environ = dict(os.environ if environ is None else environ)
    return {"host": socket.gethostname(), "net": _network_namespace(), "node_id": _slurm_node_index(environ),
            "node": environ.get("SLURMD_NODENAME") or socket.gethostname()}  # fmt: skip


def spawned_layout(places: list[dict], environ: dict[str, str] | None = None) -> dict:
    """The launch's layout (what ``RuntimeEnv.as_rank`` takes) from every rank's ``where``, made by rank 0: nodes
    simulated ($HPC_SIMULATE_RANKS_PER_NODE), else Slurm's node index, else one node per host."""
    environ = dict(os.environ if environ is None else environ)
    size = len(places)
    simulate = environ.get(SIMULATE_VAR, "").strip()
    if simulate:
        topology = _topology(None, environ, simulate, size, 0)
        names = _node_names(None, environ, simulate, topology, size, places[0]["host"])
    else:
        if all(p["node_id"] is not None for p in places):
            ids = [p["node_id"] for p in places]
        else:
            dense = {host: i for i, host in enumerate(dict.fromkeys(p["host"] for p in places))}
            ids = [dense[p["host"]] for p in places]
        topology = Topology.from_node_ids(ids)
        names = tuple(p["node"] for p in places)
    hosts = [p["host"] for p in places]
    counts, seen, host_local = Counter(hosts), Counter(), []
    for host in hosts:
        host_local.append((seen[host], counts[host]))
        seen[host] += 1
    return {"world_size": size, "hosts": hosts, "one_network": len({(p["host"], p["net"]) for p in places}) == 1,
            "node_names": list(names), "simulated_nodes": bool(simulate), "launch_id": environ.get(LAUNCH_VAR, ""),
            "node_ids": [topology.node_of(r) for r in range(size)], "host_local": host_local}  # fmt: skip


def own_env(environ: dict[str, str] | None = None) -> RuntimeEnv:
    """This process's own facts (the scheduler's variables, CPUs, the keeper), the launch's layout left as one
    rank alone: ``from_mpi`` and ``from_spawn`` fill it in, a warm spare takes a rank's (``as_rank``)."""
    environ = dict(os.environ if environ is None else environ)
    return RuntimeEnv(
        rank=-1,
        world_size=1,
        host_local_rank=0,
        host_local_size=1,
        hostname=socket.gethostname(),
        slurm_node=environ.get("SLURMD_NODENAME"),
        hosts=(),
        one_network=True,
        node_names=(),
        topology=Topology(1, 1),
        simulated_nodes=False,
        cpus=len(os.sched_getaffinity(0)),
        slurm_job_id=slurm_job_id(environ),
        slurm_restart_count=slurm_restart_count(environ),
        data_cache=data_cache(environ),
        launch_id=environ.get(LAUNCH_VAR, ""),
        inject=inject.parse(environ.get(INJECT_VAR, "")),
        tracking_vars=tuple((k, environ[k]) for k in (TRACKING_VAR, MLFLOW_URI_VAR) if k in environ),
        **keeper_fields(environ),
    )


def keeper_fields(environ: dict[str, str]) -> dict:
    """The keeper's address and the store's key (job.spare_ranks), the key dropped from this process's environment
    (nothing it starts inherits it)."""
    text = environ.get(KEEPER_VAR, "").strip()
    if not text:
        return {}
    key = os.environ.pop(STORE_KEY_VAR, "") or environ.get(STORE_KEY_VAR, "")
    try:
        return {"keeper": KeeperAddress.parse(text), "store_key": bytes.fromhex(key)}
    except ValueError:
        raise UserError(f"environment variable {KEEPER_VAR}={text!r} is not ADDR:STORE_PORT:LIVE_PORT, or "
                        f"{STORE_KEY_VAR} is not hex: the launcher sets both") from None  # fmt: skip


def _check_slurm_world(environ: dict[str, str], size: int, hostname: str) -> None:
    """UserError where Slurm started several tasks but each sees an MPI world of its own (a mismatched plugin)."""
    slurm_tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
    if slurm_tasks and slurm_tasks.isdigit() and int(slurm_tasks) > 1 and size == 1:
        raise UserError(
            f"Slurm started {slurm_tasks} tasks but MPI sees a world of 1 in each (task on "
            f"{environ.get('SLURMD_NODENAME', hostname)}): srun's MPI plugin does not match this MPI library, so "
            "every task would train its own model. Use srun --mpi=pmi2 with MPICH wheels, --mpi=pmix with Open "
            "MPI wheels (config job.mpi)."
        )


def _topology(comm: MPI.Comm, environ: dict[str, str], simulate: str, size: int, leader: int) -> Topology:
    """Which rank is on which node: simulated ($HPC_SIMULATE_RANKS_PER_NODE), Slurm's node index, or the hosts
    (``leader``: the world rank of the first rank on this host). Collective outside a simulation."""
    slurm_node = _slurm_node_index(environ)
    if simulate:
        try:
            per_node = int(simulate)
        except ValueError:
            raise UserError(f"environment variable {SIMULATE_VAR}={simulate!r} must be an integer.") from None
        return Topology(size, per_node)
    if slurm_node is not None:  # the scheduler's node index is the node (also for several slurmd on one host)
        return Topology.from_node_ids(comm.allgather(slurm_node))
    leaders = comm.allgather(leader)
    dense = {lead: i for i, lead in enumerate(dict.fromkeys(leaders))}
    return Topology.from_node_ids([dense[lead] for lead in leaders])


def _slurm_node_index(environ: dict[str, str]) -> int | None:
    """This task's node index inside a Slurm step (SLURM_NODEID), None outside one."""
    node_id = environ.get("SLURM_NODEID", "")
    return int(node_id) if node_id.isdigit() and environ.get("SLURM_STEP_ID") is not None else None


def _node_names(
    comm: MPI.Comm, environ: dict[str, str], simulate: str, topology: Topology, size: int, hostname: str
) -> tuple[str, ...]:
    """Every rank's node as the launcher names it. Collective outside a simulation."""
    if simulate:  # the local launcher names its simulated nodes (they keep their names when the world shrinks)
        labels = [x for x in environ.get(NODE_LABELS_VAR, "").split(",") if x]
        nodes = (topology.node_of(r) for r in range(size))
        return tuple(labels[n] if n < len(labels) else f"node{n}" for n in nodes)
    return tuple(comm.allgather(environ.get("SLURMD_NODENAME") or hostname))


def patient_barrier(comm: MPI.Comm, poll_s: float = 0.002, timeout_s: float | None = None) -> bool:
    """Wait for every rank without taking a core: MPICH's blocking collectives spin, which slows the rank still
    working (docs/measurements/notes-trainer.md). Costs up to ``poll_s`` of latency: for start-up checks, not for the
    training loop. With ``timeout_s``, gives up after that long; whether every rank arrived."""
    request = comm.Ibarrier()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not request.Test():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def patient_allgather(comm: MPI.Comm, value: T) -> list[T]:
    """``comm.allgather`` for a meeting the ranks reach at different times (start-up, a restore's checks, a stop,
    the teardown): they wait in ``patient_barrier`` first, so none spins while another still works."""
    patient_barrier(comm)
    return comm.allgather(value)


def patient_bcast(comm: MPI.Comm, value: T, root: int = 0) -> T:
    """``comm.bcast`` after ``patient_barrier``: the others wait without spinning while ``root`` works alone."""
    patient_barrier(comm)
    return comm.bcast(value, root=root)


def agree(comm: MPI.Comm, error: str | None) -> None:
    """Collective check: if any rank has an error, every rank raises UserError naming the first failing rank.

    Lets one rank's bad input (say, a corrupt shard it opened) stop all ranks cleanly instead of leaving the
    others blocked in the next collective.
    """
    errors = patient_allgather(comm, error)
    for rank, message in enumerate(errors):
        if message is not None:
            text = message if message.startswith("rank ") else f"rank {rank}: {message}"
            raise UserError(text, collective=True, rank=rank)


def largest(comm: MPI.Comm, values: dict, kind: type = int) -> dict:
    """Each entry's largest value over the ranks (collective)."""
    return {k: kind(comm.allreduce(v, op=MPI.MAX)) for k, v in values.items()}
