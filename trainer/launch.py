"""A launch once its parts are built: start (restore, the all-reduce plan, checks, preflight, the start event),
train with the diagnosis of what ends it early, and finish (the stop or done event, the summary)."""

from __future__ import annotations

import contextlib
import logging
import time

from mpi4py import MPI

from runconfig.load import config_hash
from rundir import RunDir
from rundir.contract import (
    EVENT_DONE,
    EVENT_PRUNED,
    EVENT_RESUME,
    EVENT_SPIKE,
    EVENT_START,
    EVENT_STOPPED,
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_STOPPED,
    FAILURE_CORRUPT,
    FAILURE_CRASH,
    FAILURE_SPIKE,
    FAILURE_STRAGGLER,
    append_event,
)
from storage.files import write_json_atomic
from trainer.boot import Booted
from trainer.build import check_overlap, plan_allreduce, restore_or_start
from trainer.checkpoint.fingerprint import params_sha256
from trainer.errors import UserError
from trainer.failure import report_failure
from trainer.loop.parts import Parts
from trainer.loop.prune import Pruned, Pruner
from trainer.loop.spikes import LossSpike, record_skip
from trainer.loop.stopreport import LeadCheck, stopped_fields
from trainer.loop.train import train
from trainer.observe.memory import state_bytes
from trainer.observe.metrics import truncate_metrics
from trainer.observe.preflight import run_preflight
from trainer.observe.record import gather_launch_record, write_launch_record
from trainer.observe.replicas import ReplicasDiverged
from trainer.observe.startup import StartupClock
from trainer.observe.stragglers import NodeEvicted
from trainer.observe.timing import peak_memory_mb
from trainer.observe.tracker_sink import launch_tags
from trainer.parallel.distributed import gloo_threads

log = logging.getLogger("trainer")


def start(parts: Parts, booted: Booted, rundir: RunDir, comm: MPI.Comm, clock: StartupClock) -> bool:
    """Restore or start, settle the all-reduce, run the preflight and record the launch's start or resume event.
    False when the preflight named a node (monitor.preflight: exclude; every rank, in failure.json). Collective."""
    resumed = restore_or_start(parts, rundir)
    plan_allreduce(parts, rundir)  # comm.allreduce=auto: after the restore, which may hold the plan to reuse
    check_overlap(parts)  # the overlapped reduction against the synchronous one, on the plan's sizes
    clock.mark("restore")
    if not run_preflight(parts, comm, rundir):
        return False
    clock.mark("preflight")
    _release_startup_groups(parts)
    clock.note_memory(
        "startup", peak_memory_mb(booted.distributed.device)
    )  # the throw-away step and the restore included
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
    return True


def _release_startup_groups(parts: Parts) -> None:
    """Where no hook reduces with the hierarchy's groups, start-up was their last use: each gloo group keeps a
    polling thread, so they go."""
    if parts.wrapped.dispatch is not None:
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
    append_event(
        rundir.history,
        EVENT_RESUME if resumed else EVENT_START,
        step=state.step,
        world_size=env.world_size,
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


def train_diagnosed(parts: Parts, booted: Booted, rundir: RunDir, progress=None) -> tuple[object | None, int | None]:
    """Train; (how it stopped, None), or (None, EXIT_FAILED) when the ranks left a slow node out after a committed
    checkpoint. A collective that failed (a peer's connection closed) is diagnosed, reported and raised."""
    env, cfg, state = booted.env, booted.cfg, parts.state
    relaxed = progress.relaxed() if progress is not None else contextlib.nullcontext()
    pruner = Pruner(cfg, rundir, env.rank) if cfg.prune.metric else None
    if pruner is not None and cfg.prune.metric.startswith("eval") and parts.recipe.eval_data is None:
        raise UserError(  # every rank: the same recipe
            f"prune.metric {cfg.prune.metric!r} is an evaluation's, but recipe {cfg.recipe!r} has no eval_data: prune "
            "by a training metric (prune.metric: loss) or give the recipe eval_data",
            collective=True,
        )
    try:
        with relaxed:  # no MPI message while the loop trains: its progress thread wakes less often
            return train(parts, LeadCheck(cfg.job.signal_lead_s, rundir, env), _profiler(booted, rundir), pruner), None
    except Pruned as pruned:  # every rank, at a rung, its checkpoint saved: ends like a completed run
        return pruned, None
    except LossSpike as spike:  # every rank, before the spike's step is saved: back to the newest checkpoint
        info = spike.info
        if env.rank == 0:
            record_skip(rundir, info)
            fields = {k: info[k] for k in ("step", "measure", "value", "loss", "median", "skip_to_position")}
            append_event(rundir.history, EVENT_SPIKE, **fields, action="rollback", launch=env.launch_id)
        return _end_unsaved(parts, booted, rundir, info["message"], FAILURE_SPIKE, [])
    except ReplicasDiverged as diverged:  # every rank, no checkpoint: restart from the newest (checked) one
        info = diverged.info
        why = f"its weights differ from the other replicas' at step {info['step']} (silent corruption)"
        suspects = [env.suspect(r, why) for r in info["ranks"]]
        return _end_unsaved(parts, booted, rundir, info["message"], FAILURE_CORRUPT, suspects)
    except NodeEvicted as evicted:  # every rank, after a committed checkpoint: leave the slow node out
        parts.mon.watchdog.close()
        parts.checkpoints.close()
        _report_eviction(booted, rundir, evicted.info, state.step)
        return None, EXIT_FAILED
    except RuntimeError as exc:  # a collective failed (a peer's connection closed): name who went away
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        diagnosis, suspects = parts.mon.watchdog.diagnose(exc)
        message = f"rank {env.rank}: a collective failed at step {state.step + 1}{diagnosis}. The error: {first}"
        report_failure(rundir, env.rank, message, FAILURE_CRASH, suspects)  # first: see report_failure
        log.error("%s", message)
        raise


def _end_unsaved(parts: Parts, booted: Booted, rundir: RunDir, message: str, kind: str, suspects: list[dict]):
    """Every rank: the launch ends without saving this step (the launcher restarts from the newest checkpoint,
    leaving the suspects' nodes out); rank 0 reports why."""
    parts.mon.watchdog.close()
    parts.checkpoints.close()
    if booted.env.rank == 0:
        log.error("%s", message)
        report_failure(rundir, 0, message, kind, suspects)
    return None, EXIT_FAILED


def _report_eviction(booted: Booted, rundir: RunDir, info: dict, step: int) -> None:
    env = booted.env
    node = env.node_names[info["ranks"][0]]
    message = (
        f"node {info['node']} ({node}) was a straggler in {info['checks']} straggler checks in a row "
        f"(busy {info['step_time_s']:.3f} s/step, {info['ratio']:.2f}x the median node; "
        f"monitor.straggler_exclude_after={booted.cfg.monitor.straggler_exclude_after}); checkpoint committed at "
        f"step {step}, the launch ends so that the launcher leaves the node out"
    )
    if env.rank == 0:
        log.error("%s", message)
        why = f"straggler: {info['ratio']:.2f}x the median node in {info['checks']} checks in a row"
        report_failure(rundir, 0, message, FAILURE_STRAGGLER, [env.suspect(r, why) for r in info["ranks"]])


def finish(parts: Parts, booted: Booted, rundir: RunDir, comm: MPI.Comm, stopped) -> int:
    """The stop's event (EXIT_STOPPED), or the summary and the done event (EXIT_DONE). A background save is
    committed before anything else happens. Collective."""
    env, state = booted.env, parts.state
    parts.mon.watchdog.close()
    parts.checkpoints.close()
    if isinstance(stopped, Pruned):
        summary = {**_summary(parts, booted, comm), "pruned": stopped.info}
        if env.rank == 0:
            write_json_atomic(rundir.summary, summary)
            fields = {k: v for k, v in stopped.info.items() if k != "step"}  # the rung's step is the state's
            append_event(rundir.history, EVENT_PRUNED, step=state.step, launch=env.launch_id, **fields)
            log.info("pruned at step %d: %s", state.step, stopped.info["why"])
            if parts.mon.tracker is not None:
                parts.mon.tracker.tags({f"hpc.pruned.{k}": str(stopped.info[k]) for k in ("step", "value", "why")})
                parts.mon.tracker.file(rundir.summary)
                parts.mon.tracker.finish("pruned")
        return EXIT_DONE
    if stopped is not None:
        fields = stopped_fields(comm, env, booted.stop, stopped, booted.cfg.job.signal_lead_s)  # collective
        if env.rank == 0:
            append_event(rundir.history, EVENT_STOPPED, step=state.step, launch=env.launch_id, **fields)
            if parts.mon.tracker is not None:
                parts.mon.tracker.finish("stopped")
        return EXIT_STOPPED
    summary = _summary(parts, booted, comm)
    if env.rank == 0:
        write_json_atomic(rundir.summary, summary)
        append_event(rundir.history, EVENT_DONE, step=state.step, launch=env.launch_id)
        if parts.mon.tracker is not None:
            parts.mon.tracker.file(rundir.summary)
            parts.mon.tracker.finish("done")
        log.info("done: step %d loss %.4f params_sha256 %s", state.step, state.last_loss, summary["params_sha256"][:16])
    return EXIT_DONE
    # The stop handlers stay (they only set a flag) until the process ends: a stop signal arriving during the
    # teardown, after the decision is recorded, must not kill a rank with the default action.


def _summary(parts: Parts, booted: Booted, comm: MPI.Comm) -> dict:
    """summary.json (collective: the fingerprint and the largest rank's state bytes)."""
    env, state, cfg = booted.env, parts.state, booted.cfg
    return {
        "final_step": state.step,
        "final_loss": state.last_loss,
        "final_eval_loss": state.last_eval_loss,
        "tokens_seen": state.tokens_seen,
        "unit": parts.recipe.unit,
        "wall_time_s": state.elapsed_s,
        "params_sha256": params_sha256(parts.model, skip=parts.wrapped.aliases),
        "n_params": parts.wrapped.n_params,
        "recipe": cfg.recipe,
        "code_sha256": booted.code_sha256,
        "world_size": env.world_size,
        "topology": env.topology.describe(),
        "allreduce": parts.allreduce,
        "allreduce_plan": state.allreduce_plan,
        "parallel": parts.wrapped.layout.sizes(),
        "state_bytes_per_rank": largest(comm, state_bytes(parts.model, parts.optimizer)),
        "backend": booted.distributed.backend,
        "config_sha256": config_hash(cfg),
        **parts.mon.stragglers.summary(),
    }


def largest(comm: MPI.Comm, values: dict, kind: type = int) -> dict:
    """Each entry's largest value over the ranks (collective)."""
    return {k: kind(comm.allreduce(v, op=MPI.MAX)) for k, v in values.items()}


def _profiler(booted: Booted, rundir: RunDir):
    """monitor.profile_steps: a StepProfiler writing into RUN_DIR/profile/, else None."""
    span = booted.cfg.monitor.profile_range()
    if span is None:
        return None
    from trainer.observe.profile import StepProfiler

    return StepProfiler(*span, booted.distributed.device, rundir.root / "profile", booted.env.rank)
