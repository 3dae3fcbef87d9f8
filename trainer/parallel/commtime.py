"""Exposed communication per parallel dimension, for the layouts whose forward is collective (FSDP2, tensor and
pipeline parallelism) on CPU.

There, collectives block the training thread inside forward and backward, wherever the parallelism puts them, so
the tail-after-the-last-gradient measure of DDP sees none of them. Gloo's collectives carry no process group in
torch's profiler and its completion hooks are NCCL-only, so the time is taken where this trainer can draw a
boundary: the time the training thread SLEPT (trainer.observe.offcpu: waiting, not computing or queued) inside

- FSDP2's all-gathers and reduce-scatters (FSDP2's custom-collective interface, calling the same collectives):
  ``dp_shard``;
- the pipeline schedule outside its stage's own forward and backward chunks (send/recv waits, bubble included):
  ``pp``;

and the rest of the forward/backward's sleep, which falls in the collectives nothing above encloses: DTensor's
(tensor parallelism: ``tp``) and FSDP2's all-reduce across HSDP replicas (``dp_replicate``). Where both are on,
that rest is named ``tp+dp_replicate``: torch gives no boundary between them. Where neither is, it is not counted
as communication. Regions nest; a region's own time leaves out what nested regions took. On GPUs the host does
not wait for NCCL, so none of this runs there (torch.profiler's NCCL kernels carry their process group).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from trainer.observe.offcpu import SleepClock


class CommLedger:
    def __init__(self) -> None:
        self.clock = SleepClock()
        self.enabled = False  # set where the layout's collectives block the training thread (CPU, mesh path)
        self.rest: str | None = None  # the dimension(s) that sleep outside every region belongs to
        self._stack: list[list[float]] = []  # per open region: the sleep its nested regions took
        self._dims: dict[str, float] = {}

    def enable(self, rest: str | None) -> bool:
        self.enabled, self.rest = self.clock.available, rest
        return self.enabled

    @contextmanager
    def region(self, dim: str | None) -> Iterator[None]:
        """Sleep inside the block, less nested regions', counts for ``dim`` (None: for nobody, e.g. a pipeline
        stage's compute inside the schedule). Only on the training thread."""
        if not self.enabled or threading.get_ident() != self.clock.thread:
            yield
            return
        start = self.clock.now()
        self._stack.append([0.0])
        try:
            yield
        finally:
            nested = self._stack.pop()[0]
            slept = max(0.0, self.clock.now() - start)
            if dim is not None:
                self._dims[dim] = self._dims.get(dim, 0.0) + max(0.0, slept - nested)
            if self._stack:
                self._stack[-1][0] += slept

    def take(self) -> dict[str, float]:
        """Seconds per dimension since the last take."""
        out, self._dims = self._dims, {}
        return out
