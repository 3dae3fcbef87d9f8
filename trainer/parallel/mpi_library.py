"""Settings the MPI library reads from the environment at ``MPI_Init``, applied before mpi4py initialises MPI.

MPICH's network module defaults to OFI here. Under ``srun --mpi=pmi2`` slurmstepd takes each PMI-1 request with a
single ``read()`` of at most 1024 bytes. The UCX module's business cards are several kB and can encode to a request
line longer than that, which slurmstepd truncates; the ranks then die in ``MPI_Init`` on a corrupt address. OFI's
cards hold one small address per node, far from the limit. MPI here only bootstraps the ranks and agrees on small
values (the training traffic goes through torch.distributed), so the MPI transport costs nothing.

OFI providers move data only inside MPI calls. OFI's automatic data progress would fix that but can hang
``MPI_Init`` between separate hosts, so the trainer drives data progress with its own thread instead
(``trainer/parallel/mpi_progress.py``) and keeps only automatic control progress. The provider is left to
libfabric: ``FI_PROVIDER`` would also steer other libfabric users in the process, such as NCCL's OFI plugin on EFA
clusters. The evidence: docs/measurements/notes-trainer.md.

Every value is a default: a variable the user set (``job.env``, the shell, a module file) is never overwritten.
MPICH builds with a single network module ignore the variable; other MPI libraries (a site's Open MPI under
``srun --mpi=pmix``) do not read ``MPIR_CVAR_*``, need no progress thread, and are named as they are in the log.
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


def library_name(version: str) -> str:
    """The first line of ``MPI.Get_library_version()``, blanks squeezed: "MPICH Version: 5.0.2", "Open MPI v4.1.4"."""
    version = version.replace("\x00", "").strip()  # Open MPI's ends in a NUL
    first = version.splitlines()[0] if version else "unknown"
    return " ".join(first.split()).rstrip(",")


def is_mpich(version: str) -> bool:
    """Whether ``MPI.Get_library_version()`` is MPICH's (or a derivative that reads ``MPIR_CVAR_*``)."""
    return version.lstrip().startswith("MPICH")
