"""``python -m trainer --run-dir RUN_DIR``: one rank of a training job (started by mpirun or srun)."""

import logging
import os
import sys

from trainer.main import main

status = main()
# Leave without the interpreter's teardown. With torch loaded it takes 1.4-2.4 s per rank (measured: freeing
# modules and their objects), paid by every launch and every restart; nothing of the trainer's needs it: main()
# has closed what it opened (checkpoints committed, metrics, logs and data files closed, threads stopped, process
# groups destroyed). What the teardown would still do is done here: flush the streams and logs, finalize MPI.
sys.stdout.flush()
sys.stderr.flush()
logging.shutdown()
from mpi4py import MPI  # noqa: E402  (imported by trainer.main already)

if MPI.Is_initialized() and not MPI.Is_finalized():
    MPI.Finalize()
os._exit(int(status or 0))
