"""A thread that keeps MPI's messages moving while the rank waits outside MPI.

With MPICH's OFI network module (the ``tcp`` provider between hosts) a message leaves the sender only while the
sender is inside an MPI call. The trainer often sends and then waits elsewhere: rank 0 broadcasts the rendezvous
port and then waits in torch's TCPStore, a collective's last sender goes on to a gloo collective, and the message
may then never arrive. OFI's automatic data progress would deliver it but can hang multi-node starts in
``MPI_Init`` (trainer/parallel/mpi_library.py).

So data progress is driven here: every ``interval_s`` a daemon thread probes a private duplicate of the world
communicator, which runs MPICH's progress engine (mpi4py starts MPI with ``MPI_THREAD_MULTIPLE``). It is started
after ``MPI_Init`` and stopped before ``MPI_Finalize``.

While the loop trains no MPI message is sent (torch.distributed carries everything), so the thread wakes only
every ``RELAXED_INTERVAL_S`` (``relaxed``): each wake costs CPU (the GIL, MPICH polling its sockets) that ranks
sharing cores take from training (docs/measurements/overhead.md). A message sent just before the loop still
leaves within that interval.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping

from mpi4py import MPI

from trainer.parallel.mpi_library import is_mpich

DATA_AUTO_PROGRESS_VAR = "MPIR_CVAR_CH4_OFI_ENABLE_DATA_AUTO_PROGRESS"
INTERVAL_S = 0.005  # start-up, restore, stop and teardown: the ranks meet in MPI often, one after another
RELAXED_INTERVAL_S = 0.1  # while the loop trains


class ProgressThread:
    def __init__(self, comm: MPI.Comm, interval_s: float = INTERVAL_S) -> None:
        self._comm = comm.Dup()  # collective: every rank makes one
        self._interval = interval_s
        self._stopping = False
        self._wake = threading.Event()  # set to end the thread or to apply a new interval at once
        self._thread = threading.Thread(target=self._run, name="mpi-progress", daemon=True)

    @classmethod
    def start_if_needed(cls, comm: MPI.Comm, environ: Mapping[str, str] = os.environ) -> ProgressThread | None:
        """One per rank for a world of more than one rank with MPICH, unless the user turned the library's own data
        progress on (``job.env``). Collective: every rank must call it."""
        if comm.Get_size() == 1 or environ.get(DATA_AUTO_PROGRESS_VAR) == "1":
            return None
        if not is_mpich(MPI.Get_library_version()):  # the stall is MPICH's OFI module's
            return None
        progress = cls(comm)
        progress._thread.start()
        return progress

    @property
    def interval_s(self) -> float:
        return self._interval

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stopping:
                return
            self._comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    @contextlib.contextmanager
    def relaxed(self, interval_s: float = RELAXED_INTERVAL_S) -> Iterator[None]:
        """Wake every ``interval_s`` inside the block (the training loop, which sends nothing over MPI), and probe
        at once and go back to the previous interval when it ends."""
        before, self._interval = self._interval, interval_s
        try:
            yield
        finally:
            self._interval = before
            self._wake.set()

    def stop(self) -> None:
        """End the thread (before MPI_Finalize; not collective)."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
