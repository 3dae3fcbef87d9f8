"""The record of a step: built from the step clock and the boundary decision, then published to metrics.jsonl,
TensorBoard, the tracker, the live metrics, rank 0's progress bar and, at most every ``monitor.log_every_s``, a
plain log line. A record whose loss is still being agreed on (comm.defer_agreement) waits for the next boundary
(``complete``)."""

from __future__ import annotations

import logging
import time

from trainer.loop.boundary import Decision
from trainer.loop.parts import Parts
from trainer.loop.step import StepResult
from trainer.observe.timing import peak_memory_mb

log = logging.getLogger("trainer.loop")


class Publisher:
    def __init__(self, parts: Parts) -> None:
        self.p = parts
        self.boundary = time.perf_counter()  # the end of the last record's interval
        self.sched = parts.distributed.ledger.clock  # the training thread's scheduler statistics (its file kept open)
        self.waited = self.sched.waited()
        self.interval_eval = 0.0  # eval seconds inside the interval (not step time; reported apart)
        self.last_line = time.monotonic()
        self.run_start, self.first_step = time.time(), parts.state.step
        self.waiting: tuple[int, dict, float, bool] | None = None  # a record whose loss is not agreed yet
        self.last_record: dict | None = None  # the newest record written (a rung judges its metric)
        self.dispatch = parts.wrapped.dispatch  # DDP's hook: how long the gradient reduction ran (comm_busy_s)
        if self.dispatch is not None:
            self.dispatch.take_busy()  # the throw-away step's
        if parts.wrapped.pipe is not None:
            parts.wrapped.pipe.take_busy()  # likewise

    def due(self, step: int, decision: Decision, evaluated: bool, extra: dict | None) -> bool:
        return step % self.p.cfg.train.log_every == 0 or decision.last or evaluated or bool(extra) or decision.rung

    def publish(self, step: int, result: StepResult, decision: Decision, evals: dict, extra: dict | None) -> None:
        """Write the record of ``step`` (covering the steps since the last record). Its publishing is timed as
        sync, and like the checkpoint after it, falls in the next record's interval."""
        p, t = self.p, self.p.cfg.train
        now_pc = time.perf_counter()
        parts, comm_dims, steps = p.mon.clock.take()
        step_time = (now_pc - self.boundary - self.interval_eval) / steps
        self.boundary = now_pc
        waited, self.waited = self.waited, self.sched.waited()
        units = p.units_per_step
        record = {
            "step": step,
            "loss": decision.loss,  # None until agreed: then ``complete`` fills it in and writes the record
            "lr": result.lr,
            # deferred with the loss (reading it now would wait for the device's whole queue: trainer/loop/boundary.py)
            "grad_norm": None if decision.loss is None else float(result.grad_norm),
            "tokens_per_s": units / step_time,  # the recipe's units ("unit") per second
            "unit": p.recipe.unit,
            "samples_per_s": t.global_batch_size / step_time,
            "step_time_s": step_time,
            **{f"time_{name}_s": seconds / steps for name, seconds in parts.items()},
            "time_eval_s": self.interval_eval,
            # exposed communication per parallel dimension (s/step; sums to time_comm_s where measured)
            "comm_by_dim": {name: seconds / steps for name, seconds in sorted(comm_dims.items())},
            **self._pipeline(steps),
            # s/step the training thread could run but waited for a core (inside the parts or between them): an
            # oversubscribed node (data workers, threads or other jobs on the rank's cores)
            "cpu_wait_s": (self.waited - waited) / steps,
            "tokens_seen": p.state.tokens_seen,
            "peak_mem_mb": peak_memory_mb(p.distributed.device),
            "time": time.time(),
            "launch": p.env.launch_id,
            **evals,
        }
        pad = p.loader.pad_fraction(p.state.data_position - t.global_batch_size)
        if pad is not None:  # data.bucket_by_length's measure: the share of padding in this step's batch
            record["pad_fraction"] = pad
        busy = self.dispatch.take_busy() if self.dispatch is not None else None
        if busy is not None:  # the reduction's whole time where the trainer's hook ran it; time_comm_s: the part
            record["comm_busy_s"] = busy / steps  # backward waited for
        if p.mon.peak_flops and p.mon.flops_per_sample:
            samples_per_rank_s = t.global_batch_size / step_time / p.env.world_size
            record["mfu"] = samples_per_rank_s * p.mon.flops_per_sample / p.mon.peak_flops
        if extra:
            record.update(extra)
        self.interval_eval = 0.0
        if decision.loss is None:
            self.waiting = (step, record, step_time, bool(evals))
        else:
            self._write(step, record, step_time, bool(evals) or decision.last)

    def complete(self, loss: float, grad_norm: float) -> None:
        """The waiting record's loss has been agreed on (at the next boundary) and its gradient norm read: write it."""
        if self.waiting is not None:
            step, record, step_time, force = self.waiting
            self.waiting = None
            record["loss"], record["grad_norm"] = loss, grad_norm
            self._write(step, record, step_time, force)

    def _pipeline(self, steps: int) -> dict:
        """``pp_compute_s``: the seconds a step of this rank spent in its pipeline stages' own chunks (CPU, where the
        chunks' wall time is their compute); the rest of the step's time in the schedule is its bubble."""
        pipe = self.p.wrapped.pipe
        return {"pp_compute_s": pipe.take_busy() / steps} if pipe is not None and pipe.ledger is not None else {}

    def _write(self, step: int, record: dict, step_time: float, force_line: bool) -> None:
        p = self.p
        self.last_record = record
        with p.mon.clock.part("sync"):
            p.metrics.write(record)
            p.mon.tensorboard.write(record)
            if p.mon.tracker is not None:
                p.mon.tracker.write(record)
            if p.mon.live is not None:
                p.mon.live.update(record)
            if p.mon.progress is not None:
                p.mon.progress.update(record)
            self._line(step, record, step_time, force_line)

    def _line(self, step: int, record: dict, step_time: float, force: bool) -> None:
        p = self.p
        now = time.monotonic()
        if p.env.rank != 0 or not (force or now - self.last_line >= p.cfg.monitor.log_every_s):
            return
        self.last_line = now
        steps = p.cfg.train.steps
        eta = (steps - step) * (time.time() - self.run_start) / max(1, step - self.first_step)
        log.info(
            "step %d/%d loss %s eval %s lr %.2e %.0f %s/s %.3f s/step ETA %s",
            step,
            steps,
            _fmt(record.get("loss")),
            _fmt(record.get("eval_loss")),
            record["lr"],
            record["tokens_per_s"],
            p.recipe.unit,
            step_time,
            _hms(eta),
            extra={"progress": True},
        )


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
