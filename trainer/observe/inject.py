"""Faults injected on purpose, to test the straggler detector, the hang watchdog, checkpoints, storage retries and
recovery with real processes.

``HPC_INJECT`` (read by trainer/env.py) holds comma-separated faults ``KIND:RANK:VALUE`` (``KINDS`` below says what
each kind does with its value; for ``slow_part`` the rank is a task of ``python -m trainer.data prepare``). Each
``Injector`` method is the hook where the loop, the checkpointer, the loader or the preflight lets its kinds act.

Nothing is injected when the variable is unset; a malformed value is a user error naming the variable.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass

from rundir.contract import INJECT_VAR
from trainer.errors import UserError

KINDS = (
    "slow",  # SECONDS: that rank sleeps SECONDS inside forward+backward of every step (a slow GPU or node)
    "hang",  # STEP: that rank sleeps for an hour when it reaches STEP (a hung rank)
    "exit",  # STEP: that rank's process ends at once, status 0, when it reaches STEP (a rank that vanishes)
    # STEP: that rank's process ends at once, status 0, after rung STEP's checkpoint committed and before its
    # verdict (prune.*: a kill between the two)
    "exit_at_rung",
    # STEP: after optimizer step STEP that rank flips one bit of its first parameter (silent corruption of one
    # replica)
    "bitflip",
    # BATCH: that rank's loss is 50 times larger on the BATCH-th batch of the data order (1-based: the batch of step
    # BATCH in a run that skipped nothing), a bad batch that makes the loss spike
    "spike",
    "slowlink",  # SECONDS: that rank waits SECONDS before each of its preflight collectives (a slow link or NIC)
    "eio_save",  # N: the first N checkpoint file writes of that rank fail with EIO (a flaky network file system)
    "eio_read",  # N: the first N data reads of that rank fail with EIO
    # SECONDS: each part that task of the data preparation tokenizes takes SECONDS longer (a preparation slow enough
    # to be killed part-way)
    "slow_part",
    # SECONDS: that rank waits SECONDS before each checkpoint file it uploads to checkpoint.storage (an upload slow
    # enough to be killed part-way)
    "slow_upload",
    # SECONDS: that rank sleeps SECONDS just before the rendezvous, in the run's first launch that reaches it (a
    # start-up that hangs; later launches start normally)
    "hang_startup",
    # STEP: after optimizer step STEP that rank waits (at most AWAIT_STOP_S) until a stop signal reaches it, so that a
    # test's signal, however late the test sends it, lands before the run can end
    "await_stop",
)
AWAIT_STOP_S = 300.0
_EIO_LOCK = threading.Lock()  # data reads come from several prefetch threads


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    value: float


def parse(text: str) -> tuple[Fault, ...]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            kind, rank, value = item.split(":")
            fault = Fault(kind, int(rank), float(value))
        except ValueError:
            fault = Fault("", -1, 0.0)
        if fault.kind not in KINDS or fault.rank < 0:
            raise UserError(
                f"environment variable {INJECT_VAR}: {item!r} is not KIND:RANK:VALUE with KIND one of "
                f"{', '.join(KINDS)}."
            )
        faults.append(fault)
    return tuple(faults)


class Injector:
    def __init__(self, faults: tuple[Fault, ...], rank: int) -> None:
        self.faults = [f for f in faults if f.rank == rank]

    def in_compute(self, step: int) -> None:
        """Called inside forward+backward of ``step`` (1-based: the step being computed)."""
        for f in self.faults:
            if f.kind == "slow":
                time.sleep(f.value)
            elif f.kind == "hang" and step == int(f.value):
                time.sleep(3600)
            elif f.kind == "exit" and step == int(f.value):
                os._exit(0)

    def loss_factor(self, batch: int) -> float:
        """What this rank's loss of the ``batch``-th batch of the data order is multiplied by (``spike``)."""
        return 50.0 if any(f.kind == "spike" and batch == int(f.value) for f in self.faults) else 1.0

    def after_optimizer(self, step: int, model, stop) -> None:
        """Called after optimizer step ``step``: ``bitflip`` flips one bit of this rank's first parameter;
        ``await_stop`` waits until ``stop`` (the StopFlag) is requested."""
        for f in self.faults:
            if f.kind == "bitflip" and step == int(f.value):
                import torch

                with torch.no_grad():
                    p = next(model.parameters())
                    t = p.to_local() if hasattr(p, "to_local") else p
                    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
                    bit = 1 << (3 if t.element_size() == 2 else 20)  # a mantissa bit: a small, silent change
                    t.view(-1)[:1].view(ints).bitwise_xor_(bit)
            elif f.kind == "await_stop" and step == int(f.value):
                deadline = time.monotonic() + AWAIT_STOP_S
                while not stop.requested and time.monotonic() < deadline:
                    time.sleep(0.01)

    def before_verdict(self, step: int) -> None:
        """Called at rung ``step`` after its checkpoint committed, before the verdict (``exit_at_rung``)."""
        for f in self.faults:
            if f.kind == "exit_at_rung" and step == int(f.value):
                os._exit(0)

    def at_rendezvous(self, rundir) -> None:
        """Called just before the rendezvous (``hang_startup``): the first launch of the run to get here sleeps."""
        for f in self.faults:
            marker = rundir.root / f"injected_hang_startup_{f.rank}"
            if f.kind == "hang_startup" and not marker.exists():
                marker.touch()
                time.sleep(f.value)

    def before_preflight_collective(self) -> None:
        """Called before each collective (and each ping-pong) of the gang preflight (trainer/observe/preflight.py)."""
        for f in self.faults:
            if f.kind == "slowlink":
                time.sleep(f.value)

    def injects(self, kind: str) -> bool:
        return any(f.kind == kind for f in self.faults)

    def before_upload(self) -> None:
        """Called before each checkpoint file this rank uploads to checkpoint.storage (``slow_upload``)."""
        for f in self.faults:
            if f.kind == "slow_upload":
                time.sleep(f.value)

    def checkpoint_write(self, path: object) -> None:
        """Called before each checkpoint file this rank writes (``eio_save``)."""
        self._eio("eio_save", path)

    def data_read(self, path: object) -> None:
        """Called before each data read of this rank (``eio_read``), from any thread."""
        self._eio("eio_read", path)

    def _eio(self, kind: str, path: object) -> None:
        """Raise a real OSError(EIO) for ``path`` while this rank's fault of ``kind`` has failures left (its VALUE)."""
        with _EIO_LOCK:
            used = self.__dict__.setdefault("_eio_used", {})
            fault = next((f for f in self.faults if f.kind == kind and used.get(f, 0) < int(f.value)), None)
            if fault is None:
                return
            used[fault] = used.get(fault, 0) + 1
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
