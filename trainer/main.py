"""Trainer entry point, started once per rank (by mpirun or srun): ``python -m trainer --run-dir DIR``.

A launch: start-up in phases (trainer/startup/: boot, the parts (recipe, model, the rest), restore, the
all-reduce, the preflight (trainer/observe/preflight.py), begin) -> train, finish (``trainer.launch``). User errors
stop every rank with one message (written to ``failure.json`` for the launcher) and exit status 2; the process
group is destroyed and files are closed on every path.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # before the heavy imports: a launch's start-up cost counts from here

import gc  # noqa: E402

# Start-up's imports run with the cyclic garbage collector off: they leave nothing to collect, yet set off full
# collections that walk everything imported so far (docs/measurements/notes-trainer.md). ``_collector_back_on``
# turns it on again.
gc.disable()

from trainer.loop.stop import EarlySignals  # noqa: E402

# A stop signal during the imports or MPI_Init is recorded, not fatal: the run stops cleanly at its first step.
EARLY_SIGNALS = EarlySignals()

from trainer.observe.deadline import StartupDeadline  # noqa: E402

STARTUP_DEADLINE = StartupDeadline(PROCESS_START)  # a start-up that hangs ends (monitor.startup_timeout_s)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

from trainer.parallel.mpi_library import apply_defaults  # noqa: E402

MPI_DEFAULTS = apply_defaults()  # before MPI starts: the MPI library reads these at MPI_Init

from mpi4py import MPI  # noqa: E402

from rundir import RunDir  # noqa: E402
from rundir.contract import EXIT_FAILED, EXIT_USER_ERROR, FAILURE_CRASH, FAILURE_USER  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.failure import abort_job, describe, meet, report_failure  # noqa: E402
from trainer.parallel.mpi_progress import ProgressThread  # noqa: E402


def run(rundir: RunDir, comm: MPI.Comm, progress: ProgressThread | None = None) -> int:
    """Train to the configured step count; return the exit status (0 done, EXIT_STOPPED stopped by a signal,
    EXIT_FAILED a node left out). Start-up runs its phases in order, each in its module of trainer/startup/;
    everything built is closed on every path (an ExitStack)."""
    # Imported here so that `--help` and config errors do not pay for importing torch.
    from trainer.launch import finish, train_diagnosed
    from trainer.observe.preflight import run_preflight
    from trainer.observe.startup import StartupClock
    from trainer.startup.allreduce import settle_allreduce
    from trainer.startup.begin import begin
    from trainer.startup.boot import boot
    from trainer.startup.parts import build_parts
    from trainer.startup.restore import restore_or_start

    # DDP's constructor imports torch._dynamo: import it in the background while this thread reads the config and
    # the MPI layout and meets the other ranks, which import nothing; joined before the parts are built. Never
    # beside this thread's own imports (docs/measurements/notes-trainer.md).
    importer = threading.Thread(target=_import_quietly, args=("torch._dynamo",), daemon=True)
    importer.start()
    clock = StartupClock(PROCESS_START)
    booted = boot(rundir, comm, clock, EARLY_SIGNALS, MPI_DEFAULTS, STARTUP_DEADLINE)
    importer.join()
    _collector_back_on()
    with contextlib.ExitStack() as stack:
        if booted.tracker is not None:  # closed last: after the checkpoints, whose commits it is told of
            stack.callback(booted.tracker.close)
        parts = build_parts(
            booted.cfg,
            booted.env,
            booted.distributed,
            rundir,
            comm,
            booted.stop,
            stack,
            code_sha256=booted.code_sha256,
            clock=clock,
            tracker=booted.tracker,
        )
        clock.mark("build")
        resumed = restore_or_start(parts, rundir)
        settle_allreduce(parts, rundir)  # after the restore, which may hold the plan to reuse
        clock.mark("restore")
        if not run_preflight(parts, comm, rundir):  # a node named, monitor.preflight: exclude (in failure.json)
            return EXIT_FAILED  # every rank: all judged the same gathered figures; the normal teardown follows
        clock.mark("preflight")
        begin(parts, booted, rundir, comm, clock, resumed)
        stopped, failed = train_diagnosed(parts, booted, rundir, progress)
        if failed is not None:
            return failed
        return finish(parts, booted, rundir, comm, stopped)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory holding config.yaml")
    args = parser.parse_args(argv)
    rundir = RunDir(args.run_dir)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    clean = False
    progress = ProgressThread.start_if_needed(comm)  # messages keep moving while this rank waits outside MPI
    try:
        status = run(rundir, comm, progress)
        clean = True
        return status
    except UserError as exc:
        if rank == 0 or not exc.collective:
            report_failure(rundir, rank if exc.rank is None else exc.rank, str(exc), FAILURE_USER)
        if not exc.collective and comm.Get_size() > 1:
            # Only this rank stopped (say, on a corrupt window it read mid-training): the others may be blocked in
            # a collective waiting for it. End every rank now with the user-error status, the report written.
            abort_job(comm, EXIT_USER_ERROR)
        meet(comm)
        return EXIT_USER_ERROR
    except OSError as exc:
        # Storage that kept failing past its retries (storage/ioretry.py): a crash, restarted in the job. One that
        # every rank raised (a checkpoint's GaveUp) is reported by rank 0 and ends every rank without an abort.
        collective = getattr(exc, "collective", False)
        if rank == 0 or not collective:
            text = str(exc) if collective else f"rank {rank}: {str(exc).splitlines()[0][:300]}"
            notes = "; ".join(getattr(exc, "__notes__", []))
            report_failure(rundir, rank, f"{text} ({notes})" if notes else text, FAILURE_CRASH)  # before any output
            traceback.print_exc()
        if not collective:
            abort_job(comm, EXIT_FAILED)
        return EXIT_FAILED
    except Exception as exc:
        # Anything else (a collective failed because a peer went away, a bug): the other ranks may be blocked
        # in a collective, or in MPI_Finalize's barrier waiting for a rank that is gone. Abort the whole MPI job
        # so the launcher ends every rank at once; failure.json (the exception and where) and the traceback first.
        report_failure(rundir, rank, describe(rank, exc), FAILURE_CRASH)
        traceback.print_exc()
        abort_job(comm, EXIT_FAILED)
        raise  # not reached
    finally:
        if "torch.distributed" in sys.modules:  # nothing to tear down if torch was never imported
            from trainer.parallel.distributed import shutdown

            shutdown(comm, clean=clean)
        if progress is not None:
            progress.stop()


def _collector_back_on() -> None:
    """The garbage collector on again once the heavy imports are done, their objects first frozen (moved out of
    its sight: the loop's collections then do not walk them again; modules live as long as the process anyway)."""
    gc.freeze()
    gc.enable()


def _import_quietly(name: str) -> None:
    """Import ``name`` to have it loaded early; any failure is left to the import that needs it (a run that ends
    during start-up may end while this thread is still importing)."""
    with contextlib.suppress(BaseException):
        importlib.import_module(name)
