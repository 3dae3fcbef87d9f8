"""``python -m trainer --run-dir RUN_DIR``: one rank of a training job (started by mpirun or srun)."""

import logging
import os
import sys

# trainer.main first: its first lines install the early stop-signal handlers (a signal during the imports must be
# a clean stop: tests/mp/test_checkpoint.py sends one while the processes start).
from trainer.main import main  # isort: skip

from rundir.contract import EXIT_DONE, EXIT_STOPPED, EXIT_USER_ERROR  # noqa: E402
from trainer.loop.stop import ignore_stop_signals  # noqa: E402

#: Outcomes after which every rank has met (the last barrier of a clean shutdown, or the user error's meeting) with
#: the outcome on record (summary.json and the done event, the stopped event after the committed checkpoint, or
#: failure.json): the ranks leave together and at once. Any other failure takes the usual exit.
MET = (EXIT_DONE, EXIT_STOPPED, EXIT_USER_ERROR)

status = main()
ignore_stop_signals()
if status not in MET:
    sys.exit(status)
# Leave without the interpreter's teardown: with torch loaded it is slow (freeing modules and their objects), paid
# by every launch, and nothing of the trainer's needs it: main() has closed what it opened (checkpoints committed,
# metrics, logs and data files closed, threads stopped, process groups destroyed). Leaving together matters under
# srun --kill-on-bad-exit: the first rank to exit non-zero gets the others killed, and the teardown's spread between
# ranks would get a stopped run's slower ranks killed mid-teardown (the launcher reads the outcome from the run
# directory: hpc/policy/outcome.py). What the teardown would still do is done here: flush the streams and logs,
# finalize MPI.
sys.stdout.flush()
sys.stderr.flush()
logging.shutdown()
from mpi4py import MPI  # noqa: E402  (imported by trainer.main already)

if MPI.Is_initialized() and not MPI.Is_finalized():  # not with job.spare_ranks: no MPI there
    MPI.Finalize()
os._exit(status)
