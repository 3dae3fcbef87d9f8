"""The step clock's device-clock mode (CUDA events on GPUs, read a step late so nothing drains the queue), run here
with host-clock events that keep the same contract: each phase's time, exposed communication after the last
gradient, when the events are read, and what the straggler check sees."""

from __future__ import annotations

import time

import pytest
import torch

from trainer.observe.timing import StepClock
from trainer.parallel.comm import BlockedIntervals


class HostEvent:
    """A timing event on a clock the test moves (``HostEvent.now``, seconds): recorded now, complete at once; counts
    the waits for it. A test's phases take exactly the time it says, however loaded the machine is."""

    waits = 0
    now = 0.0

    def record(self) -> None:
        self.at = HostEvent.now

    def synchronize(self) -> None:
        HostEvent.waits += 1

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.at - self.at) * 1000.0


def one_step(clock: StepClock, model: torch.nn.Module, tail_s: float) -> None:
    """One step on the events' clock: data 20 ms, forward+backward 5 ms, ``tail_s`` after the last gradient, optimizer
    10 ms."""
    with clock.part("data"):
        HostEvent.now += 0.02
    with clock.backward(synchronizing=True):
        HostEvent.now += 0.005
        model(torch.ones(4, 8)).sum().backward()
        HostEvent.now += tail_s  # after the last gradient: what DDP's wait for its all-reduce looks like
    with clock.part("optim"):
        HostEvent.now += 0.01
    clock.end_step()


def test_device_clock_phases_are_read_a_step_late_and_add_up():
    model = torch.nn.Linear(8, 8)
    HostEvent.waits = 0
    clock = StepClock(torch.device("cpu"), list(model.parameters()), BlockedIntervals(), tail_dim="dp_replicate",
                      events=HostEvent)  # fmt: skip
    one_step(clock, model, tail_s=0.03)
    assert HostEvent.waits == 0 and clock.busy_so_far() == 0.0  # nothing read in the step that recorded them
    one_step(clock, model, tail_s=0.03)
    assert HostEvent.waits == 1  # step 1 read at the end of step 2: one wait, for its last event
    # step 1's data + compute + optim, not its exposed communication
    assert clock.busy_so_far() == pytest.approx(0.02 + 0.005 + 0.01)
    parts, dims, steps = clock.take()  # reads step 2 as well
    assert HostEvent.waits == 2 and steps == 2
    assert parts["data"] == pytest.approx(2 * 0.02) and parts["optim"] == pytest.approx(2 * 0.01), parts
    assert parts["comm"] == pytest.approx(2 * 0.03), parts  # the tail after the last gradient
    assert parts["compute"] == pytest.approx(2 * 0.005), parts
    assert dims == {"dp_replicate": parts["comm"]}
    assert clock.take()[2] == 0 and clock.take()[0]["data"] == 0.0  # taken once
    clock.close()


def test_a_micro_batch_that_does_not_synchronize_has_no_exposed_communication():
    model = torch.nn.Linear(8, 8)
    clock = StepClock(torch.device("cpu"), list(model.parameters()), BlockedIntervals(), events=HostEvent)
    with clock.backward(synchronizing=False):
        model(torch.ones(4, 8)).sum().backward()
        HostEvent.now += 0.02
    clock.end_step()
    parts, _, steps = clock.take()
    assert steps == 1 and parts["comm"] == 0.0 and parts["compute"] == pytest.approx(0.02)
    clock.close()


def test_host_clock_phases_count_in_the_step_that_ran_them():
    """Without events (CPU, or monitor.device_sync on a GPU) each phase is host time, counted at once."""
    model = torch.nn.Linear(8, 8)
    clock = StepClock(torch.device("cpu"), list(model.parameters()), BlockedIntervals())
    with clock.part("data"):
        time.sleep(0.02)
    assert clock.busy_so_far() >= 0.02
    clock.end_step()
    assert clock.take()[0]["data"] >= 0.02
    clock.close()


def test_the_end_of_backward_is_taken_before_a_reducers_final_wait():
    """DDP's reducer queues the wait for its all-reduce as a final callback of the autograd engine, from a post-hook
    on each parameter's gradient accumulator, at the last gradient. That wait is exposed communication: the clock's
    end of compute (the last gradient) must be taken before it, else it would count as compute."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    params = list(model.parameters())
    queued = []

    def reducer_hook(*_):  # DDP's autograd hook: at the last gradient, queue the wait for the reduction
        queued.append(1)
        if len(queued) == len(params):
            torch.autograd.Variable._execution_engine.queue_callback(lambda: time.sleep(0.1))

    accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]  # held, as DDP holds them
    for acc in accumulators:  # hooked before the clock's, on the accumulators, as DDP (built first) hooks them
        acc.register_hook(reducer_hook)
    clock = StepClock(torch.device("cpu"), params, BlockedIntervals(), tail_dim="dp_replicate")
    for _ in range(2):
        queued.clear()
        with clock.backward(synchronizing=True):
            model(torch.ones(4, 8)).sum().backward()
        clock.end_step()
    parts, dims, steps = clock.take()
    # host clock: a loaded machine only lengthens the sleep, so no upper bound on comm; the wait counted as compute
    # would make compute at least 0.2 s
    assert steps == 2 and parts["comm"] >= 2 * 0.1, parts
    assert parts["compute"] < 2 * 0.1, parts
    clock.close()
