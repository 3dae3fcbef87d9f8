"""Settings the MPI library reads from the environment at ``MPI_Init``, applied before mpi4py initialises MPI.

Why MPICH's network module defaults to OFI here. Under ``srun --mpi=pmi2`` the MPICH wheel talks the PMI-1 wire
protocol to slurmstepd, whose handler takes each request with a single ``read()`` of at most 1024 bytes (Slurm's
``mpi/pmi2/pmi1.c``: "TODO: read until newline"). MPICH's business-card exchange puts values in segments of 511
bytes, hex-encoded with run-length compression of repeated bytes: up to 1022 characters plus ``cmd=put
kvsname=JOB.STEP key=... value=``. With the UCX module the cards are several kB of addresses and their encoded
length depends on their contents; when a segment's line passes 1024 bytes, slurmstepd stores the truncated value
and parses the rest as a new request (``mpi/pmi2: value not properly terminated in client request``, ``full
request is: 3333...``), and the ranks then die in ``MPI_Init`` on a corrupt address (UCX ``addr version``
assertions, ``mm_sysv`` shmat errors). The OFI module puts one 16-byte address per node (measured: 66-byte
requests whatever the ranks per node), far from the limit. MPI here only bootstraps the ranks and agrees on small
values; the training traffic goes through torch.distributed (NCCL or gloo), so the MPI transport costs nothing.

OFI providers move data only inside MPI calls (libfabric picks ``tcp`` between hosts here): rank 0 broadcasts the
rendezvous port and then waits in torch's TCPStore, and the ranks on other nodes never receive the broadcast
(measured: delivered only when rank 0 next called MPI). OFI's automatic data progress would deliver it, but with it
about one 3-node start in ten hung in ``MPI_Init`` between separate hosts, so the trainer drives data progress with
its own thread instead (``trainer/parallel/mpi_progress.py``); automatic control progress is kept (0 hangs in 30
starts with it). The provider itself is left to libfabric: ``FI_PROVIDER`` would also steer other libfabric users
in the process, such as NCCL's OFI plugin on EFA clusters.

Every value is a default: a variable the user set (``job.env``, the shell, a module file) is never overwritten.
MPICH builds with a single network module ignore the variable; other MPI libraries do not read ``MPIR_CVAR_*``.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

NETMOD_VAR = "MPIR_CVAR_CH4_NETMOD"
DEFAULTS = {
    NETMOD_VAR: "ofi",
    "MPIR_CVAR_CH4_OFI_ENABLE_CONTROL_AUTO_PROGRESS": "1",
}


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each of ``DEFAULTS`` that ``environ`` lacks; return the ones set (call before importing mpi4py.MPI)."""
    applied = {name: value for name, value in DEFAULTS.items() if name not in environ}
    environ.update(applied)
    return applied
