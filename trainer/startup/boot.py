"""A launch's first steps on every rank: the config and the recipe's code, the MPI environment, logging, the stop
flag, threads, the device and the process groups. What it returns is what the build needs."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch
from mpi4py import MPI

from runconfig import ConfigError, RunConfig, load_config
from rundir import RunDir
from rundir import snapshot as code
from rundir.contract import KEEPER_VAR
from storage import shm
from trainer.env import RuntimeEnv, agree, from_mpi, from_spawn, own_env, spawned_layout, where
from trainer.errors import UserError
from trainer.loop.stop import EarlySignals, StopFlag
from trainer.loop.stopreport import record_signal_path
from trainer.observe import noderelay
from trainer.observe.deadline import StartupDeadline
from trainer.observe.hostmem import fix_mmap_threshold
from trainer.observe.inject import Injector
from trainer.observe.startup import StartupClock
from trainer.observe.tracker_sink import Tracker, open_tracker
from trainer.parallel.distributed import Distributed, backend_of, init_distributed, join_generation, pick_device
from trainer.parallel.fdlimit import needed, raise_open_files
from trainer.parallel.groupcomm import GroupComm, SoloComm
from trainer.parallel.keeper import LAYOUT_KEY
from trainer.parallel.mpi_library import is_mpich, library_name
from trainer.parallel.rejoin import KeeperLink

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class Booted:
    cfg: RunConfig
    code_sha256: str | None  # the recipe's code snapshot, first on sys.path (None: built in or installed)
    env: RuntimeEnv
    stop: StopFlag
    distributed: Distributed
    tracker: Tracker | None  # rank 0's (None elsewhere or with tracking off)


def boot(
    rundir: RunDir,
    comm: MPI.Comm,
    clock: StartupClock,
    early: EarlySignals,
    mpi_defaults: dict[str, str],
    deadline: StartupDeadline | None = None,
) -> Booted:
    """Read the config, activate the code snapshot, read the MPI environment, meet the other ranks, and bring up
    the process groups. Bad input stops every rank with the same UserError."""
    try:  # deterministic checks: every rank fails the same way
        cfg = load_config(str(rundir.config))
        code_sha256 = code.activate(rundir)  # the recipe's code as submitted, first on sys.path
        env = from_mpi(comm)
    except (ConfigError, UserError) as exc:
        raise UserError(str(exc), collective=True) from None
    clock.slowest_imports = comm.allreduce(clock.slowest_imports, op=MPI.MAX)
    clock.mark("mpi")
    agree(comm, rundir.writable_error() if env.rank == 0 else None)
    setup_logging(rundir, env.rank)
    if deadline is not None:
        deadline.limit(cfg.monitor.startup_timeout_s, rundir.rank_log(env.rank) if rundir.logs.is_dir() else None)
    # Early (collective: a store that cannot be written is found here): rank 0's sender imports the tracker's
    # client and opens its run (seconds of CPU, at the lowest priority) while the launch starts, not while its first
    # steps run.
    tracker = open_tracker(cfg, env, rundir, comm)
    fix_mmap_threshold(cfg.train.host_mmap_threshold_kb)  # before the model and data take memory
    stop = _stop_flag(cfg, early)
    torch.set_num_threads(cfg.job.threads_per_rank or env.default_threads())
    log.info(
        "rank %d/%d on %s%s: node %d local rank %d%s, %d threads, pid %d",
        env.rank,
        env.world_size,
        env.hostname,
        f" (slurm node {env.slurm_node})" if env.slurm_node else "",
        env.node,
        env.local_rank,
        " (simulated nodes)" if env.simulated_nodes else "",
        torch.get_num_threads(),
        os.getpid(),
    )
    record_signal_path(rundir, env, cfg.checkpoint.stop_signals, early, comm)  # for `python -m hpc selftest`
    if env.host_local_rank == 0:  # what ranks of an earlier, killed launch left on this host
        removed = shm.sweep()
        relays = noderelay.sweep()
        if relays:
            log.info("removed %d stale relay folder(s) of killed launches from %s", len(relays), relays[0].parent)
        if removed:
            log.info("removed %d stale MPI shared-memory segment(s) from %s", len(removed), shm.SHM_DIR)
    if env.rank == 0:
        version = MPI.Get_library_version()
        log.info("MPI library: %s", library_name(version))
        if mpi_defaults and is_mpich(version):
            applied = " ".join(f"{name}={value}" for name, value in mpi_defaults.items())
            log.info("MPI library defaults applied (set them in job.env to choose otherwise): %s", applied)
    Injector(env.inject, env.rank).at_rendezvous(rundir)
    device = pick_device(env, cfg.train.device)
    # gloo's connections: its backend's, or beside NCCL's in every group (offload)
    _open_files(env, backend_of(cfg.comm, device) == "gloo" or cfg.parallel.offload, comm)
    d = init_distributed(env, cfg.comm, device, comm, host_tensors=cfg.parallel.offload)
    clock.mark("rendezvous")
    if deadline is not None:
        deadline.end()
    return Booted(cfg=cfg, code_sha256=code_sha256, env=env, stop=stop, distributed=d, tracker=tracker)


def boot_spawned(
    rundir: RunDir, clock: StartupClock, early: EarlySignals, deadline: StartupDeadline | None = None
) -> tuple[Booted, GroupComm]:
    """``boot`` for a rank started without MPI (job.spare_ranks: by the local launcher's hpc/spawn.py, or srun with
    no MPI plugin). The ranks meet in the keeper's store for the launch's layout (rank 0 leaves it there for the
    spares too), then over their process group (``GroupComm``) for the same checks as ``boot``."""
    try:  # deterministic checks: every rank fails the same way
        cfg = load_config(str(rundir.config))
        code_sha256 = code.activate(rundir)
        own = from_spawn()
    except (ConfigError, UserError) as exc:
        raise UserError(str(exc), collective=True) from None
    if own.keeper is None:
        raise UserError(f"rank {own.rank}: started without MPI but with no keeper ({KEEPER_VAR}): the launcher "
                        "starts one with job.spare_ranks", collective=True)  # fmt: skip
    if deadline is not None:
        deadline.limit(cfg.monitor.startup_timeout_s, rundir.rank_log(own.rank) if rundir.logs.is_dir() else None)
    link = KeeperLink(own.keeper, own.store_key, cfg.comm.timeout_s, cfg.monitor.heartbeat_s)
    link.hello("rank", own.rank, own.slurm_node or own.hostname)
    layout = link.meet(own.rank, own.world_size, where(), spawned_layout, cfg.comm.timeout_s)
    env = own.as_rank(own.rank, layout)
    setup_logging(rundir, env.rank)
    fix_mmap_threshold(cfg.train.host_mmap_threshold_kb)
    stop = _stop_flag(cfg, early)
    torch.set_num_threads(cfg.job.threads_per_rank or env.default_threads())
    log.info("rank %d/%d on %s%s: node %d local rank %d%s, started without MPI (job.spare_ranks), %d threads, "
             "pid %d", env.rank, env.world_size, env.hostname, f" (slurm node {env.slurm_node})" if env.slurm_node
             else "", env.node, env.local_rank, " (simulated nodes)" if env.simulated_nodes else "",
             torch.get_num_threads(), os.getpid())  # fmt: skip
    Injector(env.inject, env.rank).at_rendezvous(rundir)
    device = pick_device(env, cfg.train.device)
    _open_files(env, True, SoloComm())  # this rank's own limit: the others check theirs
    d = join_generation(env, cfg.comm, device, link, 0)
    comm = GroupComm(None, env.store_key)
    clock.mark("rendezvous")
    agree(comm, rundir.writable_error() if env.rank == 0 else None)
    tracker = open_tracker(cfg, env, rundir, comm)
    record_signal_path(rundir, env, cfg.checkpoint.stop_signals, early, comm)
    if env.host_local_rank == 0:  # what ranks of an earlier, killed launch left on this host
        removed, relays = shm.sweep(), noderelay.sweep()
        if removed or relays:
            log.info("removed %d stale MPI segment(s) and %d relay folder(s) of killed launches", len(removed),
                     len(relays))  # fmt: skip
    if deadline is not None:
        deadline.end()
    return Booted(cfg=cfg, code_sha256=code_sha256, env=env, stop=stop, distributed=d, tracker=tracker), comm


def boot_spare(rundir: RunDir, spare: int, clock: StartupClock, early: EarlySignals):  # noqa: ANN201
    """A warm spare (job.spare_ranks): imported, it waits at the keeper for a dead rank's place; then that rank's
    environment, logging, device, the generation's process groups and the recipe, built alone. (Booted, comm), or
    None when the launch ended without needing it."""
    cfg = load_config(str(rundir.config))
    code_sha256 = code.activate(rundir)
    own = own_env()
    link = KeeperLink(own.keeper, own.store_key, cfg.comm.timeout_s, cfg.monitor.heartbeat_s)
    link.hello("spare", spare, own.slurm_node or own.hostname)
    place = link.assignment(spare)  # as it waits, its link is the process's: a failure from here says "fail"
    if place.get("close"):
        link.bye()
        return None
    layout = link.wait(LAYOUT_KEY, cfg.monitor.rejoin_timeout_s)
    if layout is None or "error" in layout:
        raise RuntimeError(f"spare {spare}: the launch's layout is not in the keeper's store "
                           f"({layout['error'] if layout else 'none'})")  # fmt: skip
    env = own.as_rank(int(place["rank"]), layout)
    setup_logging(rundir, env.rank)
    log.info("spare %d takes rank %d's place in generation %d (pid %d)", spare, env.rank, place["gen"], os.getpid())
    if env.rank == 0 and cfg.tracking.backend not in ("off", False):
        log.warning("rank 0's place taken by a spare: tracking stops for this launch (the next launch resumes it)")
    stop = _stop_flag(cfg, early)
    torch.set_num_threads(cfg.job.threads_per_rank or env.default_threads())
    device = pick_device(env, cfg.train.device)
    d = join_generation(env, cfg.comm, device, link, int(place["gen"]))
    clock.mark("rendezvous")
    return Booted(cfg=cfg, code_sha256=code_sha256, env=env, stop=stop, distributed=d, tracker=None), GroupComm(
        None, env.store_key
    )


def _open_files(env: RuntimeEnv, gloo: bool, comm: MPI.Comm) -> None:
    """Every rank's soft limit on open files raised to its hard limit before the store and gloo connect (collective:
    a hard limit too low for the world stops every rank, naming the rank)."""
    per_node = env.topology.ranks_per_node
    before, now, error = raise_open_files(env.rank, env.world_size, env.hostname, gloo=gloo, ranks_per_node=per_node)
    if now != before:
        log.info("open files: soft limit raised from %d to %d (about %d needed at %d ranks)", before, now,
                 needed(env.rank, env.world_size, gloo=gloo, ranks_per_node=per_node), env.world_size)  # fmt: skip
    agree(comm, error)


def _stop_flag(cfg: RunConfig, early: EarlySignals) -> StopFlag:
    """The stop handlers; a signal during start-up (from the process's first lines on) is honoured at step 1."""
    stop = StopFlag(cfg.checkpoint.stop_signals, early=early)
    if stop.signum is not None:
        log.info("stop signal %d arrived during start-up: the run stops at its first step boundary", stop.signum)
    if stop.ignored_early is not None:
        log.warning(
            "signal %d arrived during start-up; it is not in checkpoint.stop_signals: ignored", stop.ignored_early
        )
    return stop


def setup_logging(rundir: RunDir, rank: int) -> None:
    fmt = logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    handlers: list[logging.Handler] = []
    if rundir.logs.is_dir():
        handlers.append(logging.FileHandler(rundir.rank_log(rank)))
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        if sys.stdout.isatty():  # a progress bar is drawn there instead of the periodic step lines
            console.addFilter(lambda record: not getattr(record, "progress", False))
        handlers.append(console)
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
