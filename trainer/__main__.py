"""``python -m trainer --run-dir RUN_DIR``: one rank of a training job (started by mpirun or srun)."""

import logging
import os
import sys

from trainer.loop.stop import ignore_stop_signals
from trainer.main import main

status = main()
ignore_stop_signals()
if status:
    # Stopped (75) or failed: the usual exit. srun (--kill-on-bad-exit) kills the ranks still running when one
    # exits non-zero and then reports the killed ones' status; with the usual teardown (~2 s each) the ranks leave
    # at about the same time, and a quicker exit here was measured to get the others killed mid-exit (a bad-input
    # error reported as a crash). (The local launcher's mpirun only sends them SIGUSR1, a notice: trainer/loop/stop.py.)
    sys.exit(status)
# Done: leave without the interpreter's teardown. With torch loaded it takes 1.4-2.4 s per rank (measured: freeing
# modules and their objects), paid by every run; nothing of the trainer's needs it: main() has closed what it
# opened (checkpoints committed, metrics, logs and data files closed, threads stopped, process groups destroyed).
# What the teardown would still do is done here: flush the streams and logs, finalize MPI.
sys.stdout.flush()
sys.stderr.flush()
logging.shutdown()
from mpi4py import MPI  # noqa: E402  (imported by trainer.main already)

if MPI.Is_initialized() and not MPI.Is_finalized():
    MPI.Finalize()
os._exit(0)
