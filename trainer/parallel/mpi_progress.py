"""A thread that keeps MPI's messages moving while the rank waits outside MPI.

With MPICH's OFI network module (the ``tcp`` provider between hosts) a message leaves the sender only while the
sender is inside an MPI call. The trainer often sends and then waits elsewhere: rank 0 broadcasts the rendezvous
port and then waits in torch's TCPStore, a collective's last sender goes on to a gloo collective. Measured between
separate hosts (envs/slurm/cluster.sh with HPC_SLURM_NETNS=1): a broadcast reached the other nodes only when rank 0
next called MPI, 4 s later in the test, never in the trainer. OFI's automatic data progress delivers it, but with it
8 to 13 % of 3-node starts hung in ``MPI_Init`` (3, 3, 4 and 1 of 30), every rank spinning in MPICH's progress
loop; without it, 0 of 90.

So data progress is driven here: every ``interval_s`` a daemon thread probes a private duplicate of the world
communicator, which runs MPICH's progress engine (mpi4py starts MPI with ``MPI_THREAD_MULTIPLE``). A broadcast then
arrives within ~10 ms. It is started after ``MPI_Init`` and stopped before ``MPI_Finalize``.

While the loop trains, no MPI message is sent (torch.distributed carries everything), so the thread wakes every
``RELAXED_INTERVAL_S`` instead (``relaxed``). At 5 ms each rank's thread took ~11 ms of CPU a second (a wake, the
GIL, MPICH polling its sockets): with 2 x 2 ranks on 2 cores, 7.9 ms of the 327 ms of CPU a training step cost
(2.4 %); relaxed, 0.5 ms (per-thread CPU from /proc, bench/README). A message sent just before the loop still
leaves within that interval.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping

from mpi4py import MPI

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
        """One per rank for a world of more than one rank, unless the user turned the library's own data progress
        on (``job.env``). Collective: every rank must call it."""
        if comm.Get_size() == 1 or environ.get(DATA_AUTO_PROGRESS_VAR) == "1":
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
