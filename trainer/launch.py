"""A launch once its parts are built: start (restore, the all-reduce plan, checks, preflight, the start event),
train with the diagnosis of what ends it early, and finish (the stop or done event, the summary)."""

from __future__ import annotations

import contextlib
import logging

from mpi4py import MPI

from runconfig.load import config_hash
from rundir import RunDir
from rundir.contract import (
    EVENT_DONE,
    EVENT_PRUNED,
    EVENT_SPIKE,
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
from trainer.checkpoint.fingerprint import params_sha256
from trainer.env import largest
from trainer.errors import UserError
from trainer.failure import report_failure
from trainer.loop.parts import Parts
from trainer.loop.prune import Pruned, Pruner
from trainer.loop.spikes import LossSpike, record_skip
from trainer.loop.stopreport import LeadCheck, stopped_fields
from trainer.loop.train import train
from trainer.observe.memory import state_bytes
from trainer.observe.replicas import ReplicasDiverged
from trainer.observe.stragglers import NodeEvicted
from trainer.observe.timing import peak_memory_mb
from trainer.parallel.rejoin import PEER_GONE, PeerLost, PlanWatch
from trainer.startup.boot import Booted

log = logging.getLogger("trainer")


def train_diagnosed(
    parts: Parts, booted: Booted, rundir: RunDir, progress=None, watch: PlanWatch | None = None
) -> tuple[object | None, int | None]:
    """Train; (how it stopped, None), or (None, EXIT_FAILED) when the ranks left a slow node out after a committed
    checkpoint. A collective that failed (a peer's connection closed) is diagnosed, reported and raised; with a
    keeper (``watch``, job.spare_ranks) a rank's death the keeper planned a new generation for raises PeerLost."""
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
        if watch is not None and (watch.plan is not None or PEER_GONE.search(str(exc))):
            plan = watch.plan or watch.link.plan(watch.next, cfg.monitor.rejoin_timeout_s)
            if plan is not None and "fallback" not in plan:
                log.warning("rank %d: a collective failed at step %d; generation %d: %s", env.rank, state.step + 1,
                            plan["gen"], plan)  # fmt: skip
                raise PeerLost(plan) from exc
            if plan is not None:
                log.error("rank %d: no in-process restart (%s): the launch restarts", env.rank, plan["fallback"])
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
    parts.checkpoints.remove_memory()  # done, pruned or stopped with a durable checkpoint: none needed again
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
        # each rank's peak (the device's on GPUs, else the host's resident set) and the runtime's part of a host peak
        "memory_mb_per_rank": comm.allgather(
            {"runtime": parts.runtime_mb, "peak": round(peak_memory_mb(booted.distributed.device), 1)}
        ),
        "backend": booted.distributed.backend,
        "config_sha256": config_hash(cfg),
        **parts.mon.stragglers.summary(),
    }


def _profiler(booted: Booted, rundir: RunDir):
    """monitor.profile_steps: a StepProfiler writing into RUN_DIR/profile/, else None."""
    span = booted.cfg.monitor.profile_range()
    if span is None:
        return None
    from trainer.observe.profile import StepProfiler

    return StepProfiler(*span, booted.distributed.device, rundir.profile, booted.env.rank)
