"""The training driver: optimizer steps (``train_step``) from the state's step to ``train.steps``, each followed by
the boundary decision (stop, checkpoint, eval: the same on every rank), the straggler check and the record."""

from __future__ import annotations

import logging
import time

from rundir.checkpoints import read_latest
from trainer.loop.boundary import Boundary, Earlier
from trainer.loop.evaluate import evaluate
from trainer.loop.parts import Parts
from trainer.loop.prune import Pruner
from trainer.loop.publish import Publisher
from trainer.loop.spikes import SpikeWatch
from trainer.loop.step import train_step
from trainer.loop.stopreport import LeadCheck, StopTimes
from trainer.observe.profile import StepProfiler
from trainer.observe.stragglers import NodeEvicted

log = logging.getLogger(__name__)


def train(
    parts: Parts, lead: LeadCheck | None = None, profiler: StepProfiler | None = None, pruner: Pruner | None = None
) -> StopTimes | None:
    """Train until ``train.steps``. A stop signal ends it early with a committed checkpoint: then the stop's clock
    readings (trainer/loop/stopreport.py), else None. ``lead`` checks the signal's lead time after each save;
    ``profiler`` records the steps of ``monitor.profile_steps`` (written however the loop ends); ``pruner`` judges
    the rung steps of prune.* (raising Pruned on every rank after the rung's checkpoint)."""
    try:
        return _train(parts, lead, profiler, pruner)
    finally:
        if profiler is not None:
            profiler.close()


def _checks_and_eval(parts: Parts, step: int, due_eval: bool, publisher: Publisher) -> tuple[dict | None, dict]:
    """The straggler check on this step's busy time (before end_step: its all-gather is sync time of this step),
    then the evaluation when due: (the straggler check's fields or None, the eval metrics or {})."""
    mon = parts.mon
    mon.stragglers.add(mon.clock.busy_so_far())
    extra = None
    if mon.stragglers.due(step):
        mon.watchdog.enter("straggler all-gather", step)
        with mon.clock.part("sync"):
            extra = mon.stragglers.check(step)
    evals: dict = {}
    if due_eval:
        mon.watchdog.enter("eval", step)
        eval_start = time.perf_counter()
        evals = evaluate(parts, step)
        parts.state.last_eval_loss = evals["eval_loss"]
        publisher.interval_eval += time.perf_counter() - eval_start
    return extra, evals


def _train(
    parts: Parts, lead: LeadCheck | None, profiler: StepProfiler | None, pruner: Pruner | None
) -> StopTimes | None:
    state, mon, t = parts.state, parts.mon, parts.cfg.train
    log.info(
        "training steps %d..%d: world %d (%d nodes x %d), grad accumulation %d, %s all-reduce, device %s",
        state.step,
        t.steps,
        parts.env.world_size,
        parts.env.topology.num_nodes,
        parts.env.topology.ranks_per_node,
        parts.accum,
        parts.allreduce,
        parts.distributed.device,
    )
    publisher = Publisher(parts)
    boundary = Boundary(parts)
    spikes = SpikeWatch(t)

    def newest() -> str | None:
        return read_latest(parts.checkpoints.root)

    def agreed_later(earlier: Earlier | None) -> None:
        """A step's loss agreed after its boundary (comm.defer_agreement): its record can be written now."""
        if earlier is not None:
            state.last_loss = earlier.loss
            publisher.complete(earlier.loss, earlier.grad_norm)

    if pruner is not None and state.step and pruner.due(state.step):  # resumed from a rung's checkpoint
        mon.watchdog.enter("rung", state.step)
        pruner.judge_resumed(state.step)
    run_start, elapsed_before = time.time(), state.elapsed_s
    parts.loader.start(state.data_position)
    parts.wrapped.module.train()
    while state.step < t.steps:
        step = state.step + 1
        if profiler is not None:
            profiler.before(step)
        step_start = time.perf_counter()
        result = train_step(parts, step)
        mon.injector.after_optimizer(step, parts.model)
        mon.watchdog.enter("metric all-reduce", step)
        decision = boundary.decide(step, result.loss, result.grad_norm)
        agreed, step_s = time.time(), time.perf_counter() - step_start
        agreed_later(decision.earlier)  # the previous step's
        state.step = step
        state.data_position += t.global_batch_size
        state.tokens_seen += parts.units_per_step
        if decision.loss is not None:
            state.last_loss = decision.loss
        state.elapsed_s = elapsed_before + time.time() - run_start
        if spikes.on:  # before this step's checkpoint: a spike's step is never saved
            if decision.earlier is not None:  # comm.defer_agreement: the previous step's figures, agreed now
                earlier = decision.earlier
                spikes.see(step - 1, earlier.loss, earlier.grad_norm, state.data_position - t.global_batch_size, newest)
            if decision.loss is not None:
                norm = float(result.grad_norm) if spikes.grad_factor else 0.0  # read (a device sync) if judged
                spikes.see(step, decision.loss, norm, state.data_position, newest)
        extra, evals = _checks_and_eval(parts, step, decision.eval, publisher)
        if mon.replicas is not None and mon.replicas.due(step, decision.checkpoint):  # before the checkpoint
            mon.watchdog.enter("replica check", step)
            with mon.clock.part("sync"):
                mon.replicas.check(parts.model, step)
        mon.clock.end_step()
        # The record is written before this step's checkpoint: a kill between a commit and its record would lose
        # the record for good (the resumed run starts after it). A checkpoint's blocking time is therefore counted
        # in the next record; the last one of a launch (at a stop or at the end) in none: it is teardown.
        if publisher.due(step, decision, bool(evals), extra):
            publisher.publish(step, result, decision, evals, extra)
        if decision.checkpoint:
            mon.watchdog.enter("checkpoint", step)
            save_start = time.time()
            with mon.clock.part("ckpt"):
                parts.checkpoints.save(state, block=decision.stop or decision.last)
            if lead is not None and not decision.stop:
                lead.after_save(step, step_s, parts.checkpoints.last_save_s)
        if profiler is not None:
            profiler.after(step)
        if decision.rung and pruner is not None and pruner.due(step):
            mon.watchdog.enter("rung", step)
            if mon.injector.injects("exit_at_rung"):  # a test's kill between the rung's commit and its verdict
                parts.checkpoints.wait()
                mon.injector.before_verdict(step)
            pruner.judge(step, publisher.last_record)
        if extra and "evict" in extra and not decision.last:
            agreed_later(boundary.settle())  # every rank is here (the straggler check is collective)
            if not decision.checkpoint:  # the launch ends here: nothing computed so far is lost
                mon.watchdog.enter("checkpoint", step)
                with mon.clock.part("ckpt"):
                    parts.checkpoints.save(state, block=True)
            raise NodeEvicted(extra["evict"])
        if decision.stop:
            log.info("stop requested (signal); stopped at step %d with a committed checkpoint", state.step)
            return StopTimes(agreed=agreed, save_start=save_start, committed=time.time())
    return None
