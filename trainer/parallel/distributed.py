"""Process-group set-up from the MPI environment: rendezvous, the default group, and the (node, local) groups of
the hierarchical all-reduce.

This is the one place process groups are created; every rank creates them in the same order.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

from runconfig.schema import CommConfig
from trainer.env import RuntimeEnv, patient_barrier
from trainer.errors import UserError
from trainer.parallel.comm import HierGroups
from trainer.parallel.commtime import CommLedger
from trainer.parallel.rejoin import KeeperLink
from trainer.parallel.storeseal import new_secret


@dataclass(frozen=True)
class Distributed:
    backend: str
    device: torch.device
    groups: HierGroups
    store_addr: str  # the rendezvous TCPStore (on rank 0's host): the hang watchdog's heartbeats go there too
    store_port: int
    # This launch's key for the values the package writes to the store (trainer/parallel/storeseal.py): made by
    # rank 0, handed over by MPI; never written anywhere.
    store_secret: bytes = field(default=b"", repr=False, compare=False)
    # Exposed communication per parallel dimension where the layout's collectives block this thread (CPU mesh
    # layouts); built here, on the training thread, whose sleep it measures.
    ledger: CommLedger = field(default_factory=CommLedger, compare=False)
    # With job.spare_ranks: the generation (0, then one more per in-process restart), whose keys in the keeper's
    # store carry this prefix, and the link to the keeper
    gen: int = 0
    store_prefix: str = ""
    keeper: KeeperLink | None = field(default=None, repr=False, compare=False)


def pick_device(env: RuntimeEnv, device: str) -> torch.device:
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError(f"rank {env.rank} on {env.hostname}: train.device is 'cuda' but no GPU is visible.")
        index = env.host_local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def gpu_identity(device: torch.device) -> str:
    """The physical GPU behind ``device``: its UUID (the same whatever CUDA_VISIBLE_DEVICES numbers it), else its
    PCI bus id."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return f"pci {getattr(props, 'pci_bus_id', '?')}:{getattr(props, 'pci_device_id', '?')}"


def shared_gpus(placements: list[tuple[str, str]]) -> list[tuple[int, int, str]]:
    """(rank, earlier rank, host) for every rank placed on a GPU that an earlier rank already uses;
    ``placements[rank]`` is (host, GPU identity)."""
    first: dict[tuple[str, str], int] = {}
    out = []
    for rank, where in enumerate(placements):
        if where in first:
            out.append((rank, first[where], where[0]))
        else:
            first[where] = rank
    return out


def check_one_rank_per_gpu(env: RuntimeEnv, device: torch.device, comm: MPI.Comm) -> None:
    """NCCL refuses two ranks on one GPU, deep in its set-up ("Duplicate GPU detected", or a hang on older
    versions): say so first, on every rank alike, with the numbers to change. Identities are compared, not
    device counts: under Slurm's GPU binding each rank may see only its own GPU, as device 0."""
    placements = comm.allgather((env.hostname, gpu_identity(device)))
    shared = shared_gpus(placements)
    if not shared:
        return
    rank, other, host = shared[0]
    on_host = sum(1 for h, _ in placements if h == host)
    gpus = len({g for h, g in placements if h == host})
    raise UserError(
        f"ranks {other} and {rank} on {host} would share one GPU ({len(shared)} rank(s) without a GPU of their own; "
        f"{on_host} ranks on that host, {gpus} distinct GPU(s) visible to them): NCCL allows one rank per GPU. "
        "Set job.ranks_per_node (and job.gpus_per_node) to the GPUs per node, check CUDA_VISIBLE_DEVICES, or set "
        "comm.backend: gloo to let ranks share a GPU (slow; for tests)."
    )


log = logging.getLogger(__name__)
_LISTENERS: list[socket.socket | None] = []


def rendezvous_address(env: RuntimeEnv, cfg: CommConfig) -> str:
    if cfg.master_addr:
        return cfg.master_addr
    return "127.0.0.1" if env.single_host else env.hosts[0]


def store_listener(addr: str, env: RuntimeEnv) -> socket.socket | None:
    """A socket listening on ``addr`` (what the other ranks connect to) for rank 0's store, which torch would
    otherwise open on every interface; None (every interface, with a warning) where ``addr`` resolves to a loopback
    address but ranks run on other hosts (a hostname mapped to 127.0.1.1 on rank 0's host alone)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    if ipaddress.ip_address(sockaddr[0]).is_loopback and not env.single_host:
        log.warning("rendezvous address %s is %s on rank 0's host: the store listens on every interface (set "
                    "comm.master_addr to the host's cluster address)", addr, sockaddr[0])  # fmt: skip
        return None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(sockaddr[:2] if family == socket.AF_INET else sockaddr)
    sock.listen(min(socket.SOMAXCONN * 16, 65535))
    return sock


def backend_of(cfg: CommConfig, device: torch.device) -> str:
    """comm.backend, auto resolved: NCCL on GPUs, gloo on CPUs."""
    return cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")


def init_distributed(
    env: RuntimeEnv, cfg: CommConfig, device: torch.device, comm: MPI.Comm, *, host_tensors: bool = False
) -> Distributed:
    """Rank 0 opens a TCPStore on a free port (chosen by the OS, so no race), MPI broadcasts the port, and all
    ranks join the default group; then the (node, local) mesh is built from the topology. ``host_tensors``
    (parallel.offload): NCCL's groups also get gloo for tensors in host memory (an offloaded shard's gradient norm,
    gathered parameters for a checkpoint's fingerprint), as torchtitan does."""
    backend = backend_of(cfg, device)
    if backend == "nccl" and device.type == "cuda":
        check_one_rank_per_gpu(env, device, comm)
    timeout = timedelta(seconds=cfg.timeout_s)
    addr = rendezvous_address(env, cfg)
    port = None
    error = None
    secret = new_secret() if env.rank == 0 else None
    if env.rank == 0:
        try:
            listener = store_listener(addr, env)
            _LISTENERS.append(listener)  # the store uses its descriptor: kept open as long as the process
            fd = {"master_listen_fd": listener.fileno()} if listener is not None else {}
            port = listener.getsockname()[1] if listener is not None else 0
            store = dist.TCPStore(addr, port, env.world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                                  **fd)  # fmt: skip
            port = store.port
            where = listener.getsockname()[0] if listener is not None else "every interface"
            log.info("rendezvous store on %s:%d (listening on %s)", addr, port, where)
        except (RuntimeError, OSError) as exc:
            error = f"rank 0 on {env.hostname} cannot open the rendezvous store on {addr}: {exc}"
    port, error, secret = comm.bcast((port, error, secret), root=0)
    if error:
        raise UserError(error + " (set comm.master_addr to an address of rank 0's host).")
    if env.rank != 0:
        store = dist.TCPStore(addr, port, env.world_size, is_master=False, timeout=timeout)
    both = "cuda:nccl,cpu:gloo" if host_tensors and backend == "nccl" else backend
    dist.init_process_group(both, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    return Distributed(backend, device, _groups(env, cfg, timeout), store_addr=addr, store_port=int(port),
                       store_secret=secret)  # fmt: skip


def join_generation(env: RuntimeEnv, cfg: CommConfig, device: torch.device, link: KeeperLink, gen: int) -> Distributed:
    """With a keeper (job.spare_ranks): the default group and the hierarchy's of generation ``gen``, on the keeper's
    store under the generation's prefix (a generation's ranks meet only their own)."""
    backend = backend_of(cfg, device)
    if backend == "nccl":  # GroupComm and the connection cut that wakes a blocked collective are gloo's
        raise UserError("job.spare_ranks: in-process restarts run on the gloo backend only so far (CPU ranks, or "
                        "comm.backend: gloo); set job.spare_ranks: 0 for NCCL", collective=True)  # fmt: skip
    timeout = timedelta(seconds=cfg.timeout_s)
    prefix = f"hpc/g{gen}/"
    store = dist.PrefixStore(prefix, link.store)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    where = env.keeper
    return Distributed(backend, device, _groups(env, cfg, timeout), store_addr=where.addr, store_port=where.store_port,
                       store_secret=env.store_key, gen=gen, store_prefix=prefix, keeper=link)  # fmt: skip


def _groups(env: RuntimeEnv, cfg: CommConfig, timeout: timedelta) -> HierGroups:
    topo = env.topology
    return HierGroups(
        intra=own_group(topo.intra_groups(), env.rank, timeout),
        inter=own_group(topo.inter_groups(), env.rank, timeout),
        ranks_per_node=topo.ranks_per_node,
        num_nodes=topo.num_nodes,
        compress=cfg.compress == "bf16",
        chunk_bytes=int(cfg.chunk_kb * 1024),
        world=dist.new_group(),  # the flat algorithm's inside hooks (apart from the default group's traffic)
    )


def gloo_threads() -> int:
    """This process' gloo transport threads: one per gloo group (each wakes on a timer, used or not:
    ``HierGroups.release``)."""
    tasks, names = Path("/proc/self/task"), []
    if not tasks.is_dir():  # not Linux: not counted
        return 0
    for task in tasks.iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append((task / "comm").read_text().strip())
    return names.count("gloo_tcp_loop")


def own_group(sets: list[list[int]], rank: int, timeout: timedelta) -> dist.ProcessGroup:
    """This rank's group among ``sets`` (disjoint, covering every rank): every rank creates every group, in order
    (``new_group`` is collective over all ranks), and keeps its own; one set of all ranks is the default group.
    Plain groups rather than a DeviceMesh's: nothing here needs the mesh, and its groups outlive a release
    (``HierGroups.release``: the mesh keeps them)."""
    if len(sets) == 1:
        return dist.group.WORLD
    mine = None
    for ranks in sets:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


def shutdown(comm: MPI.Comm, *, clean: bool) -> None:
    """Destroy the process groups. On a clean exit all ranks first meet, and meet again (over MPI) after the
    destroy, so rank 0, which hosts the rendezvous store, never leaves while another rank still talks to it
    (that aborts the others with "terminate called without an active exception"). After an error nobody waits:
    a dead peer would hang the exit."""
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()
    if clean and isinstance(comm, MPI.Comm):  # with a keeper (job.spare_ranks) the store is not rank 0's
        patient_barrier(comm)
