"""The training driver: optimizer steps (``train_step``) from the state's step to ``train.steps``, each followed by
the boundary decision (stop, checkpoint, eval: the same on every rank), the straggler check and the record."""

from __future__ import annotations

import contextlib
import logging
import time

from rundir.checkpoints import read_latest
from trainer.loop.boundary import Boundary, Decision, Earlier
from trainer.loop.evaluate import evaluate
from trainer.loop.parts import Parts
from trainer.loop.prune import Pruner
from trainer.loop.publish import Publisher
from trainer.loop.spikes import SpikeWatch
from trainer.loop.step import StepResult, train_step
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


def _train(
    parts: Parts, lead: LeadCheck | None, profiler: StepProfiler | None, pruner: Pruner | None
) -> StopTimes | None:
    """The loop: each optimizer step, its boundary decision, the checks, the record, the checkpoint."""
    _log_start(parts)
    run = _Run(parts, lead, pruner)
    run.begin()
    state = parts.state
    while state.step < parts.cfg.train.steps:
        step = state.step + 1
        if profiler is not None:
            profiler.before(step)
        result, decision, step_s, agreed = run.step(step)
        run.advance(step, decision)
        run.meet(step, decision)
        run.watch_spikes(step, result, decision)
        extra, evals = run.checks(step, decision)
        # The record is written before this step's checkpoint: a kill between a commit and its record would lose
        # the record for good (the resumed run starts after it). A checkpoint's blocking time is therefore counted
        # in the next record; the last one of a launch (at a stop or at the end) in none: it is teardown.
        if run.publisher.due(step, decision, bool(evals), extra):
            run.publisher.publish(step, result, decision, evals, extra)
        save_start = run.checkpoint(step, decision, step_s) if decision.checkpoint else None
        if decision.memory and not decision.stop and not decision.last:  # beside a durable one too: faster to load
            run.checkpoint_in_memory(step)
        if profiler is not None:
            profiler.after(step)
        run.judge_rung(step, decision)
        if extra and "evict" in extra and not decision.last:
            run.leave_evicted(step, decision, extra["evict"])
        if decision.stop:  # a stop's decision always checkpoints: save_start is set
            log.info("stop requested (signal); stopped at step %d with a committed checkpoint", state.step)
            return StopTimes(agreed=agreed, save_start=save_start, committed=time.time())
    return None


def _log_start(parts: Parts) -> None:
    t, topology = parts.cfg.train, parts.env.topology
    log.info(
        "training steps %d..%d: world %d (%d nodes x %d), grad accumulation %d, %s all-reduce, device %s",
        parts.state.step,
        t.steps,
        parts.env.world_size,
        topology.num_nodes,
        topology.ranks_per_node,
        parts.accum,
        parts.allreduce,
        parts.distributed.device,
    )


class _Run:
    """What the loop keeps from step to step (the boundary, the publisher, the spike watch, the launch's clock) and
    the named parts of one step's boundary handling."""

    def __init__(self, parts: Parts, lead: LeadCheck | None, pruner: Pruner | None) -> None:
        self.parts, self.lead, self.pruner = parts, lead, pruner
        self.publisher = Publisher(parts)
        self.boundary = Boundary(parts)
        self.spikes = SpikeWatch(parts.cfg.train)
        self.run_start = self.elapsed_before = 0.0

    def begin(self) -> None:
        """Judge a rung resumed from, start the launch's clock and the loader, put the model in training mode."""
        parts, state, pruner = self.parts, self.parts.state, self.pruner
        if pruner is not None and state.step and pruner.due(state.step):  # resumed from a rung's checkpoint
            parts.mon.watchdog.enter("rung", state.step)
            pruner.judge_resumed(state.step)
        self.run_start, self.elapsed_before = time.time(), state.elapsed_s
        parts.loader.start(state.data_position)
        parts.wrapped.module.train()

    def step(self, step: int) -> tuple[StepResult, Decision, float, float]:
        """One optimizer step and its boundary decision: (result, decision, the step's seconds, when the ranks
        agreed on it)."""
        parts, mon = self.parts, self.parts.mon
        step_start = time.perf_counter()
        result = train_step(parts, step)
        mon.injector.after_optimizer(step, parts.model, parts.stop)
        mon.watchdog.enter("metric all-reduce", step)
        decision = self.boundary.decide(step, result.loss, result.grad_norm)
        agreed, step_s = time.time(), time.perf_counter() - step_start
        return result, decision, step_s, agreed

    def agreed_later(self, earlier: Earlier | None) -> None:
        """A step's loss agreed after its boundary (comm.defer_agreement): its record can be written now."""
        if earlier is not None:
            self.parts.state.last_loss = earlier.loss
            self.publisher.complete(earlier.loss, earlier.grad_norm)

    def advance(self, step: int, decision: Decision) -> None:
        """The state after ``step``: its counters, its agreed loss, the run's elapsed time."""
        state, t = self.parts.state, self.parts.cfg.train
        self.agreed_later(decision.earlier)  # the previous step's
        state.step = step
        state.data_position += t.global_batch_size
        state.tokens_seen += self.parts.units_per_step
        if decision.loss is not None:
            state.last_loss = decision.loss
        state.elapsed_s = self.elapsed_before + time.time() - self.run_start

    def meet(self, step: int, decision: Decision) -> None:
        """comm.sync rounds: the nodes meet at a round's end (streaming: a fragment's step; every fragment at the
        last step), before any check or checkpoint of the step."""
        outer, mon = self.parts.wrapped.outer, self.parts.mon
        fragments = outer.meeting(step, decision.last) if outer is not None else []
        if fragments:
            mon.watchdog.enter("outer sync", step)
            with mon.clock.part("sync"):
                outer.sync(fragments)

    def newest(self) -> str | None:
        return read_latest(self.parts.checkpoints.root)

    def watch_spikes(self, step: int, result: StepResult, decision: Decision) -> None:
        """Show the spike watch the figures agreed at this boundary, before this step's checkpoint: a spike's step
        is never saved."""
        spikes, state, t = self.spikes, self.parts.state, self.parts.cfg.train
        if not spikes.on:
            return
        if decision.earlier is not None:  # comm.defer_agreement: the previous step's figures, agreed now
            earlier = decision.earlier
            spikes.see(
                step - 1, earlier.loss, earlier.grad_norm, state.data_position - t.global_batch_size, self.newest
            )
        if decision.loss is not None:
            norm = float(result.grad_norm) if spikes.grad_factor else 0.0  # read (a device sync) if judged
            spikes.see(step, decision.loss, norm, state.data_position, self.newest)

    def checks(self, step: int, decision: Decision) -> tuple[dict | None, dict]:
        """The straggler check, the evaluation and the replica check when due, then the step's clock ends: (the
        straggler check's fields or None, the eval metrics or {})."""
        parts, mon = self.parts, self.parts.mon
        extra, evals = _checks_and_eval(parts, step, decision.eval, self.publisher)
        outer = parts.wrapped.outer  # comm.sync rounds: the replicas agree at the rounds' ends only
        if (
            mon.replicas is not None
            and mon.replicas.due(step, decision.checkpoint)
            and (outer is None or outer.one_model(step, decision.last))
        ):  # before the checkpoint
            mon.watchdog.enter("replica check", step)
            with mon.clock.part("sync"):
                mon.replicas.check(parts.model, step)
        mon.clock.end_step()
        return extra, evals

    def checkpoint(self, step: int, decision: Decision, step_s: float) -> float:
        """Save this step's checkpoint (blocking at a stop or the last step); when the save began."""
        parts, mon = self.parts, self.parts.mon
        mon.watchdog.enter("checkpoint", step)
        save_start = time.time()
        with mon.clock.part("ckpt"):
            parts.checkpoints.save(parts.state, block=decision.stop or decision.last)
        if self.lead is not None and not decision.stop:
            self.lead.after_save(step, step_s, parts.checkpoints.last_save_s)
        return save_start

    def checkpoint_in_memory(self, step: int) -> None:
        """Save this step's checkpoint in node memory and on the partner nodes (checkpoint.memory_every_steps)."""
        parts, mon = self.parts, self.parts.mon
        mon.watchdog.enter("checkpoint in memory", step)
        with mon.clock.part("ckpt"):
            parts.checkpoints.save_memory(parts.state)

    def judge_rung(self, step: int, decision: Decision) -> None:
        """prune.*: judge a rung step once its checkpoint is written (raises Pruned on every rank)."""
        if not (decision.rung and self.pruner is not None and self.pruner.due(step)):
            return
        mon = self.parts.mon
        mon.watchdog.enter("rung", step)
        if mon.injector.injects("exit_at_rung"):  # a test's kill between the rung's commit and its verdict
            self.parts.checkpoints.wait()
            mon.injector.before_verdict(step)
        self.pruner.judge(step, self.publisher.last_record)

    def leave_evicted(self, step: int, decision: Decision, evict: dict) -> None:
        """The straggler check evicts a node: settle the deferred agreement, checkpoint, raise NodeEvicted."""
        parts, mon = self.parts, self.parts.mon
        self.agreed_later(self.boundary.settle())  # every rank is here (the straggler check is collective)
        outer = parts.wrapped.outer
        if outer is not None and not outer.at_round_end(step, decision.last):  # one model to save: meet first
            met = outer.meeting(step, decision.last)  # streaming: a fragment met at this step already
            outer.sync([f for f in range(len(outer.fragments)) if f not in met])  # never empty: the last is due
        if not decision.checkpoint:  # the launch ends here: nothing computed so far is lost
            mon.watchdog.enter("checkpoint", step)
            with mon.clock.part("ckpt"):
                parts.checkpoints.save(parts.state, block=True)
        raise NodeEvicted(evict)


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
        outer = parts.wrapped.outer  # comm.sync rounds: the last meetings, the model a checkpoint holds
        with outer.consensus() if outer is not None else contextlib.nullcontext():
            evals = evaluate(parts, step)
        parts.state.last_eval_loss = evals["eval_loss"]
        parts.state.last_eval = {"step": step, **{k: float(v) for k, v in evals.items()}}
        publisher.interval_eval += time.perf_counter() - eval_start
    return extra, evals
