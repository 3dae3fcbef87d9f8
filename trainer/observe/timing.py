"""Where a step's time goes: data wait, forward+backward, exposed communication, optimizer, checkpoint, sync.

``StepClock`` times the phases of each step. On CPU it reads the host clock. On CUDA it records a pair of CUDA events
around each phase on the training stream and reads their device times once the device has passed them (a step later, or
when a record is written): each phase's time is the device's, and nothing drains the GPU's queue mid-step, so the host
keeps running ahead (per-phase synchronizations slow a device-bound step: docs/measurements/gpu.md). A phase that blocks
the host (a checkpoint's write) shows as the time the device waited for its end; a host wait the device did not notice
(a late batch while it still had queued work) costs nothing and counts nowhere. ``monitor.device_sync`` instead
synchronizes the device at each phase boundary and reads the host clock. The moment the last gradient was produced comes
from a CUDA event recorded by per-parameter hooks either way.
Exposed communication is the time the backward pass spends waiting on gradient communication rather than
computing (how it is counted: ``StepClock.backward``); overlapped communication is not counted.

The layouts whose forward is collective (FSDP2, tensor and pipeline parallelism) block the training thread in
their collectives wherever they fall; on CPU their exposed communication is the time the thread slept in
forward/backward, split by parallel dimension (trainer.parallel.commtime), and reported per dimension as well.
DDP's is its data-parallel dimension's (``dp_replicate``).
"""

from __future__ import annotations

import functools
import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from rundir.contract import PARTS
from trainer.parallel.comm import BlockedIntervals
from trainer.parallel.commtime import CommLedger


class Event(Protocol):
    """What the device clock needs of a timing event (``torch.cuda.Event(enable_timing=True)``'s methods)."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Event) -> float: ...  # milliseconds from this event to ``end``


class StepClock:
    def __init__(
        self,
        device: torch.device,
        params: list[torch.nn.Parameter],
        blocked: BlockedIntervals,
        on_grads_ready: Callable[[], None] | None = None,
        ledger: CommLedger | None = None,
        tail_dim: str | None = None,
        device_sync: bool = False,
        events: Callable[[], Event] | None = None,
    ) -> None:
        self.cuda = device.type == "cuda"
        self.device_sync = self.cuda and device_sync  # monitor.device_sync
        # Device-clock phases: a timing event per phase boundary (CUDA events on CUDA unless device_sync; on CPU only
        # where a caller passes an event type, e.g. host-clock events); else host-clock phases.
        self.device_clock = events is not None or (self.cuda and not self.device_sync)
        self._new_event = events or functools.partial(torch.cuda.Event, enable_timing=True)
        self._recorded: list[tuple] = []  # the step in progress' phases, as recorded events (device clock)
        self._unread: list[list[tuple]] = []  # finished steps whose events are not read yet
        self._last_busy = 0.0  # busy seconds of the newest step read (device clock)
        self.on_grads_ready = on_grads_ready  # every gradient of a synchronizing backward exists: comm remains
        self._n_params = len(params)
        self._grads_seen = 0
        self._synchronizing = False
        self.device = device
        self.blocked = blocked
        self.parts = dict.fromkeys(PARTS, 0.0)  # seconds accumulated since the last take()
        self.steps = 0
        self._step = dict.fromkeys(PARTS, 0.0)  # seconds of the step in progress
        self._last_grad: float | None = None
        self._last_grad_event: torch.cuda.Event | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        self.ledger = ledger if ledger is not None and ledger.enabled else None
        self.tail_dim = tail_dim  # the dimension the tail after the last gradient reduces over (DDP's)
        self.comm_dims: dict[str, float] = {}  # exposed communication per parallel dimension since the last take()
        self._step_dims: dict[str, float] = {}

    def _grad_ready(self, param: torch.Tensor) -> None:
        """Per-parameter hook: counts; the last gradient of a synchronizing backward takes the time."""
        self._grads_seen += 1
        if not self._synchronizing or self._grads_seen != self._n_params:
            return
        if self.cuda or self.device_clock:
            self._last_grad_event = self._event()
        else:
            self._last_grad = time.perf_counter()
        if self.on_grads_ready is not None:
            self.on_grads_ready()

    def _sync(self) -> None:
        if self.device_sync:
            torch.cuda.synchronize(self.device)

    def _event(self) -> Event:
        """A timing event recorded now on the training stream (where the device is, in stream order)."""
        event = self._new_event()
        event.record()
        return event

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        if self.device_clock:
            start = self._event()
            try:
                yield
            finally:
                self._recorded.append((name, start, self._event()))
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._step[name] += time.perf_counter() - start

    @contextmanager
    def backward(self, synchronizing: bool) -> Iterator[None]:
        """Forward+backward of one micro-batch; when ``synchronizing`` (the micro-batch whose backward reduces
        gradients), the tail after the last gradient is counted as exposed communication."""
        self._sync()
        self.blocked.take()  # intervals of an earlier backward (a no_sync micro-batch has none)
        self._last_grad, self._last_grad_event = None, None
        self._grads_seen, self._synchronizing = 0, synchronizing
        ledger = self.ledger
        if ledger is None and self.device_clock:
            start_event = self._event()
            try:
                yield
            finally:
                self.blocked.take()
                self._recorded.append(("backward", start_event, self._event(), self._last_grad_event, synchronizing))
            return
        if ledger is not None:
            ledger.take()  # what an evaluation or a checkpoint left
            slept = ledger.clock.now()
        start = time.perf_counter()
        end_event = None
        try:
            yield
            if self.cuda:
                end_event = self._event()
        finally:
            self._sync()
            end = time.perf_counter()
        total, blocked = end - start, self.blocked.take()
        exposed = 0.0
        if ledger is not None:  # collectives anywhere in forward/backward, every micro-batch's
            dims = ledger.take()
            rest = ledger.clock.now() - slept - sum(dims.values())
            if ledger.rest is not None and rest > 0:
                dims[ledger.rest] = dims.get(ledger.rest, 0.0) + rest
            for name, seconds in dims.items():
                self._step_dims[name] = self._step_dims.get(name, 0.0) + seconds
            exposed = sum(dims.values())
        elif synchronizing:
            # From the moment the last gradient is ready to the end of backward() (DDP waits there for its
            # all-reduce), plus, for a synchronous communication hook such as the hierarchical one, the time spent
            # blocked inside the hook before that moment. On GPU a synchronous hook's waits show up as compute.
            if self.cuda and end_event is not None and self._last_grad_event is not None:
                exposed = self._last_grad_event.elapsed_time(end_event) / 1000.0
            elif self._last_grad is not None:
                last = self._last_grad
                exposed = end - last + sum(max(0.0, min(e, last) - max(s, start)) for s, e in blocked)
        self._split(self._step, self._step_dims, total, exposed, tail=ledger is None and synchronizing)

    def _split(self, parts: dict, dims: dict, total: float, exposed: float, *, tail: bool) -> float:
        """Count a forward+backward's ``total`` seconds as compute and ``exposed`` communication (clamped to
        0..total) in ``parts``; ``tail``: the exposed tail after the last gradient, also counted for ``tail_dim``
        in ``dims``. Returns the compute seconds."""
        exposed = min(max(exposed, 0.0), total)
        if tail and self.tail_dim is not None:
            dims[self.tail_dim] = dims.get(self.tail_dim, 0.0) + exposed
        parts["compute"] += total - exposed
        parts["comm"] += exposed
        return total - exposed

    def _read(self, phases: list[tuple]) -> None:
        """Add one finished step's device-clock phases to the totals (waits until the device has passed them)."""
        if not phases:
            return
        phases[-1][2].synchronize()  # the step's last event: every earlier one is complete too (stream order)
        busy = 0.0
        for name, start, end, *grads in phases:
            seconds = max(0.0, start.elapsed_time(end) / 1000.0)
            if name != "backward":
                self.parts[name] += seconds
                busy += seconds if name in ("data", "optim") else 0.0
                continue
            last_grad, synchronizing = grads
            exposed = last_grad.elapsed_time(end) / 1000.0 if synchronizing and last_grad is not None else 0.0
            busy += self._split(self.parts, self.comm_dims, seconds, exposed, tail=synchronizing)
        self._last_busy = busy

    def busy_so_far(self) -> float:
        """Seconds this rank was busy in the step in progress: data, forward+backward and optimizer (not the
        time it waited for others in collectives, nor checkpoint writes). On the device clock, the newest step
        whose events were read instead (one step behind: reading the step in progress would drain the queue)."""
        if self.device_clock:
            return self._last_busy
        return self._step["data"] + self._step["compute"] + self._step["optim"]

    def end_step(self) -> None:
        """Add the finished step's parts to the totals that take() returns. On the device clock the step's events
        are read a step later (the step before it is read now: the device is done with it, or nearly)."""
        if self.device_clock:
            self._unread.append(self._recorded)
            self._recorded = []
            while len(self._unread) > 1:
                self._read(self._unread.pop(0))
        for name, seconds in self._step.items():
            self.parts[name] += seconds
        for name, seconds in self._step_dims.items():
            self.comm_dims[name] = self.comm_dims.get(name, 0.0) + seconds
        self._step = dict.fromkeys(PARTS, 0.0)
        self._step_dims = {}
        self.steps += 1

    def take(self) -> tuple[dict[str, float], dict[str, float], int]:
        """Per-part seconds summed since the last take, the exposed communication per parallel dimension (part of
        ``comm``), and the number of steps they cover (on the device clock, after waiting for the device to pass
        the last finished step's events)."""
        while self._unread:
            self._read(self._unread.pop(0))
        parts, dims, steps = self.parts, self.comm_dims, self.steps
        self.parts, self.comm_dims, self.steps = dict.fromkeys(PARTS, 0.0), {}, 0
        return parts, dims, steps

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory allocated by torch on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_mb() -> float | None:
    """This process's resident host memory now, MiB (None where /proc does not say)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (OSError, ValueError, IndexError):
        return None


def memory_now_mb(device: torch.device) -> dict[str, float]:
    """This rank's memory now, for heartbeats: resident set (MiB, from /proc), its peak, and on CUDA the device
    memory allocated by torch now. Cheap enough for a heartbeat thread (no device synchronization)."""
    out = {"peak_mb": round(peak_memory_mb(device), 1)}
    rss = resident_mb()
    if rss is not None:
        out["rss_mb"] = round(rss, 1)
    if device.type == "cuda":
        out["device_mb"] = round(torch.cuda.memory_allocated(device) / 2**20, 1)
    return out


# Dense bf16 peak TFLOP/s (no sparsity) by device name fragment, from the vendors' data sheets.
PEAK_BF16_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("L4", 121.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
)


def peak_tflops(device: torch.device, configured: float) -> float | None:
    if configured:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment in name:
            return tflops
    return None
