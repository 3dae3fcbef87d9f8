"""Start-up's last phase: the groups only start-up used released, the launch's memory and record, its start or
resume event (the records of steps it recomputes moved aside), the tracker's tags; then training begins."""

from __future__ import annotations

import logging
import time

from mpi4py import MPI

from rundir import RunDir
from rundir.contract import (
    EVENT_RESUME,
    EVENT_START,
    append_event,
)
from trainer.env import largest
from trainer.loop.parts import Parts
from trainer.observe.metrics import truncate_metrics
from trainer.observe.record import gather_launch_record, write_launch_record
from trainer.observe.startup import StartupClock
from trainer.observe.timing import peak_memory_mb
from trainer.observe.tracker_sink import launch_tags
from trainer.parallel.distributed import gloo_threads
from trainer.startup.boot import Booted

log = logging.getLogger("trainer")


def begin(parts: Parts, booted: Booted, rundir: RunDir, comm: MPI.Comm, clock: StartupClock, resumed: bool) -> None:
    """The launch's start or resume event, its record and tracker tags, once every start-up check passed.
    Collective."""
    _release_startup_groups(parts)
    # the throw-away step and the restore included
    clock.note_memory("startup", peak_memory_mb(booted.distributed.device))
    memory = largest(comm, clock.memory_mb, float)
    launch_record = gather_launch_record(booted.env, booted.distributed.device, comm)  # rank 0's, None on the others
    if booted.env.rank == 0:
        _record_start(parts, booted, rundir, clock, resumed, memory)
        try:
            write_launch_record(rundir, launch_record, parts.state.step)
        except OSError as exc:  # the record is for people; training goes on without it
            log.warning("could not write the launch record into %s: %s", rundir.record, exc)
        if parts.mon.tracker is not None:
            try:  # rank 0 alone: nothing here may end the run while the others wait in the next collective
                tags = launch_tags(
                    booted.cfg, booted.env, parts.wrapped.layout.sizes(), launch_record, rundir, booted.code_sha256
                )
                files = [(f, "record") for f in sorted(rundir.record.glob("*")) if f.is_file() and f.name[0] != "."]
                parts.mon.tracker.begin(parts.state.step, tags, files)
            except Exception as exc:
                log.warning("tracking: this launch's tags and record were not queued: %s", exc)
    log.info(
        "recipe %s: %s with %d parameters; train %d samples, eval %s",
        booted.cfg.recipe,
        type(parts.model).__name__,
        parts.wrapped.n_params,
        len(parts.recipe.train_data),
        len(parts.recipe.eval_data) if parts.recipe.eval_data is not None else "none",
    )


def _release_startup_groups(parts: Parts) -> None:
    """Where no hook reduces with the hierarchy's groups, start-up was their last use: each gloo group keeps a
    polling thread, so they go."""
    if parts.wrapped.dispatch is not None or parts.wrapped.outer is not None:  # the rounds use them
        return
    began = time.perf_counter()
    released = parts.distributed.groups.release()
    if parts.env.rank == 0 and released:
        log.info(
            "released %d process group(s) used only at start-up (no hook reduces with them); gloo threads left in "
            "this process: %d (%.3f s)",
            released,
            gloo_threads(),
            time.perf_counter() - began,
        )


def _record_start(
    parts: Parts, booted: Booted, rundir: RunDir, clock: StartupClock, resumed: bool, memory: dict
) -> None:
    """Rank 0: the launch's start or resume event, after moving the records of the steps it recomputes to
    metrics.discarded.jsonl."""
    env, state = booted.env, parts.state
    # Every launch (a fresh start after a launch that never committed too): records of steps after the state's step
    # are recomputed, so they move out of metrics.jsonl.
    discarded = truncate_metrics(rundir.metrics, state.step, rundir.metrics_discarded)
    fields = {"skipped_checkpoints": parts.checkpoints.skipped, "discarded_records": discarded} if resumed else {}
    if resumed and parts.checkpoints.restored_from is not None:  # checkpoint.memory_every_steps: from where, why
        fields["restored_from"] = parts.checkpoints.restored_from
    append_event(
        rundir.history,
        EVENT_RESUME if resumed else EVENT_START,
        step=state.step,
        world_size=env.world_size,
        device=parts.distributed.device.type,  # cuda: each rank holds one GPU (the cost's GPU-hours)
        nodes=[env.node_names[env.topology.node_ranks(n)[0]] for n in range(env.topology.num_nodes)],
        grad_accum=booted.cfg.grad_accum(env.world_size),
        slurm_job_id=env.slurm_job_id,
        slurm_restart_count=env.slurm_restart_count,
        launch=env.launch_id,
        process_start=clock.process_start,
        startup_s=clock.phases(),
        peak_mem_mb={k: round(v, 1) for k, v in memory.items()},  # the largest rank's
        recipe=booted.cfg.recipe,
        code_sha256=booted.code_sha256,
        **fields,
    )
