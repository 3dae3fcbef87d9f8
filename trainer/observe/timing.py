"""Where a step's time goes: data wait, forward+backward, exposed communication, optimizer, checkpoint, sync.

``StepClock`` times the phases of each step with the host clock. On CUDA it synchronizes the device at each
phase boundary (a handful per step; ``monitor.device_sync``) so the host clock measures device work, and it finds
the moment the last gradient was produced with CUDA events recorded by per-parameter hooks.

Exposed communication is the time the backward pass spends waiting on gradient communication rather than
computing: from the moment the last gradient is ready to the end of ``backward()`` (DDP waits there for its
all-reduce), plus, for a synchronous communication hook such as the hierarchical one, the time spent blocked
inside the hook before that moment. Communication that overlaps with computing gradients is not exposed and is
not counted. With a synchronous hook on GPU the hook's waits inside backward show up as compute.

The layouts whose forward is collective (FSDP2, tensor and pipeline parallelism) block the training thread in
their collectives wherever they fall; on CPU their exposed communication is the time the thread slept in
forward/backward, split by parallel dimension (trainer.parallel.commtime), and reported per dimension as well.
DDP's is its data-parallel dimension's (``dp_replicate``).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from runconfig.contract import PARTS
from trainer.parallel.comm import BlockedIntervals
from trainer.parallel.commtime import CommLedger


class StepClock:
    def __init__(
        self,
        device: torch.device,
        params: list[torch.nn.Parameter],
        blocked: BlockedIntervals,
        on_grads_ready: Callable[[], None] | None = None,
        ledger: CommLedger | None = None,
        tail_dim: str | None = None,
        device_sync: bool = True,
    ) -> None:
        self.cuda = device.type == "cuda"
        self.device_sync = self.cuda and device_sync  # monitor.device_sync
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
        if self.cuda:
            self._last_grad_event = torch.cuda.Event(enable_timing=True)
            self._last_grad_event.record()
        else:
            self._last_grad = time.perf_counter()
        if self.on_grads_ready is not None:
            self.on_grads_ready()

    def _sync(self) -> None:
        if self.device_sync:
            torch.cuda.synchronize(self.device)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
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
        if ledger is not None:
            ledger.take()  # what an evaluation or a checkpoint left
            slept = ledger.clock.now()
        start = time.perf_counter()
        end_event = None
        try:
            yield
            if self.cuda:
                end_event = torch.cuda.Event(enable_timing=True)
                end_event.record()
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
            exposed = min(sum(dims.values()), total)
        elif synchronizing:
            if self.cuda and end_event is not None and self._last_grad_event is not None:
                exposed = self._last_grad_event.elapsed_time(end_event) / 1000.0
            elif self._last_grad is not None:
                last = self._last_grad
                exposed = end - last + sum(max(0.0, min(e, last) - max(s, start)) for s, e in blocked)
            exposed = min(max(exposed, 0.0), total)
            if self.tail_dim is not None:
                self._step_dims[self.tail_dim] = self._step_dims.get(self.tail_dim, 0.0) + exposed
        self._step["compute"] += total - exposed
        self._step["comm"] += exposed

    def busy_so_far(self) -> float:
        """Seconds this rank was busy in the step in progress: data, forward+backward and optimizer (not the
        time it waited for others in collectives, nor checkpoint writes)."""
        return self._step["data"] + self._step["compute"] + self._step["optim"]

    def end_step(self) -> None:
        """Add the finished step's parts to the totals that take() returns."""
        for name, seconds in self._step.items():
            self.parts[name] += seconds
        for name, seconds in self._step_dims.items():
            self.comm_dims[name] = self.comm_dims.get(name, 0.0) + seconds
        self._step = dict.fromkeys(PARTS, 0.0)
        self._step_dims = {}
        self.steps += 1

    def take(self) -> tuple[dict[str, float], dict[str, float], int]:
        """Per-part seconds summed since the last take, the exposed communication per parallel dimension (part of
        ``comm``), and the number of steps they cover."""
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
