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
import logging  # noqa: E402

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
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

from rundir.contract import SPAWN_WORLD_VAR  # noqa: E402
from trainer.parallel.mpi_library import apply_defaults  # noqa: E402

MPI_DEFAULTS = apply_defaults()  # before MPI starts: the MPI library reads these at MPI_Init

# With job.spare_ranks no rank is an MPI process: the local launcher starts them itself (hpc/spawn.py), srun with
# no MPI plugin under Slurm, and a warm spare takes the place the keeper gives it.
SPAWNED = SPAWN_WORLD_VAR in os.environ
if SPAWNED or "--spare" in sys.argv:
    import mpi4py  # noqa: E402

    mpi4py.rc.initialize = False
from mpi4py import MPI  # noqa: E402

from rundir import RunDir  # noqa: E402
from rundir.contract import EXIT_FAILED, EXIT_USER_ERROR, FAILURE_CRASH, FAILURE_USER  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.failure import abort_job, describe, meet, report_failure  # noqa: E402
from trainer.parallel.mpi_progress import ProgressThread  # noqa: E402


def run(rundir: RunDir, comm: MPI.Comm, progress: ProgressThread | None = None, spare: int | None = None) -> int:
    """Train to the configured step count; return the exit status (0 done, EXIT_STOPPED stopped by a signal,
    EXIT_FAILED a node left out). Start-up runs its phases in order, each in its module of trainer/startup/;
    everything built is closed on every path (an ExitStack). With job.spare_ranks, a rank's death starts a new
    generation in these processes (``_rejoin``); ``spare``: this process is a warm spare, which waits for a place."""
    # Imported here so that `--help` and config errors do not pay for importing torch.
    from trainer.observe.startup import StartupClock
    from trainer.parallel.rejoin import PeerLost
    from trainer.startup.boot import boot, boot_spare, boot_spawned
    from trainer.startup.parts import Kept

    # DDP's constructor imports torch._dynamo: import it in the background while this thread reads the config and
    # the MPI layout and meets the other ranks, which import nothing; joined before the parts are built. Never
    # beside this thread's own imports (docs/measurements/notes-trainer.md).
    importer = threading.Thread(target=_import_quietly, args=("torch._dynamo",), daemon=True)
    importer.start()
    clock = StartupClock(PROCESS_START)
    if spare is not None:
        importer.join()
        placed = boot_spare(rundir, spare, clock, EARLY_SIGNALS)
        if placed is None:  # the launch ended without needing this spare
            return 0
        booted, comm = placed
        WHO.update(comm=comm, rank=booted.env.rank, link=booted.distributed.keeper)
    elif SPAWNED:  # job.spare_ranks: no MPI; the ranks meet over their process group
        booted, comm = boot_spawned(rundir, clock, EARLY_SIGNALS, STARTUP_DEADLINE)
        WHO.update(comm=comm, rank=booted.env.rank, link=booted.distributed.keeper)
    else:
        booted = boot(rundir, comm, clock, EARLY_SIGNALS, MPI_DEFAULTS, STARTUP_DEADLINE)
    importer.join()
    _collector_back_on()
    with contextlib.ExitStack() as outer:  # what outlives a generation: the tracker and the kept parts
        if booted.tracker is not None:  # closed last: after the checkpoints, whose commits it is told of
            outer.callback(booted.tracker.close)
        kept = Kept(outer)
        if spare is not None:  # built alone: the ranks it joins keep theirs
            from trainer.parallel.groupcomm import SoloComm
            from trainer.startup.recipe import make_recipe

            d = booted.distributed
            kept.recipe = make_recipe(booted.cfg, booted.env, d, rundir, SoloComm(), outer)
        while True:
            try:
                return _generation(rundir, comm, progress, booted, clock, kept)
            except PeerLost as lost:
                plan = lost.plan  # outside this block the failed generation (its frames, its parts) is garbage
            booted, comm = _rejoin(rundir, booted, plan)
            WHO.update(comm=comm)
            clock = StartupClock(time.time())


def _generation(rundir: RunDir, comm, progress, booted, clock, kept) -> int:
    """One generation of the launch's ranks (the only one without spares): build, restore, check, train, finish.
    ``kept``: what this process built in the generations before (``trainer.startup.parts.Kept``)."""
    from trainer.launch import finish, train_diagnosed
    from trainer.observe.preflight import run_preflight
    from trainer.parallel.rejoin import PlanWatch
    from trainer.startup.allreduce import settle_allreduce
    from trainer.startup.begin import begin
    from trainer.startup.parts import build_parts
    from trainer.startup.restore import restore_or_start

    gen, link = booted.distributed.gen, booted.distributed.keeper
    if kept.optimizer is not None:  # built in an earlier generation (a spare's first has its recipe only)
        logging.getLogger("trainer").info("rank %d keeps its %s in generation %d", booted.env.rank,
                                          ", ".join(kept.names()), gen)  # fmt: skip
    with contextlib.ExitStack() as stack:
        watch = PlanWatch(link, gen) if link is not None else None
        if watch is not None:
            stack.callback(watch.close)
        parts = build_parts(
            booted.cfg,
            booted.env,
            booted.distributed,
            rundir,
            comm,
            booted.stop,
            stack,  # the generation's parts end with it; the kept ones (model, data, optimizer, loader) outlive it
            code_sha256=booted.code_sha256,
            clock=clock,
            tracker=booted.tracker,
            kept=kept,
        )
        clock.mark("build")
        resumed = restore_or_start(parts, rundir)
        if gen > 0 and not resumed:
            # the survivors' kept model and optimizer hold steps no checkpoint covers, the spare's a fresh start:
            # only a new launch (every rank built anew) starts the run again consistently
            raise RuntimeError(
                f"generation {gen} of the in-process restart found no checkpoint in node memory or "
                "on disk to restore (a rank died before the first was written): the launch restarts"
            )
        settle_allreduce(parts, rundir)  # after the restore, which may hold the plan to reuse
        clock.mark("restore")
        if gen == 0 and not run_preflight(parts, comm, rundir):  # a node named, monitor.preflight: exclude
            return EXIT_FAILED  # every rank: all judged the same gathered figures; the normal teardown follows
        clock.mark("preflight")
        begin(parts, booted, rundir, comm, clock, resumed)
        stopped, failed = train_diagnosed(parts, booted, rundir, progress, watch)
        if failed is not None:
            return failed
        return finish(parts, booted, rundir, comm, stopped)


def _rejoin(rundir: RunDir, booted, plan: dict):
    """The broken generation's groups ended; the next one joined, with a spare in each dead rank's place."""
    import dataclasses

    from rundir.contract import EVENT_REJOIN, append_event
    from trainer.checkpoint.memory import forget_plans
    from trainer.parallel.distributed import join_generation
    from trainer.parallel.groupcomm import GroupComm
    from trainer.parallel.rejoin import end_groups

    if booted.env.rank in plan["dead"]:  # counted dead while silent (stopped, cut off): a spare has its place now
        logging.getLogger("trainer").error("rank %d: the keeper counted this process dead and gave its place to a "
                                           "spare in generation %d: it ends", booted.env.rank, plan["gen"])  # fmt: skip
        os._exit(EXIT_FAILED)  # no report, no goodbye: the launch goes on without this process
    end_groups()
    forget_plans()
    gc.collect()  # the old DDP wrapper and its reducer (hooks on the kept model's parameters) go now
    env = booted.env
    distributed = join_generation(env, booted.cfg.comm, booted.distributed.device, booted.distributed.keeper,
                                  plan["gen"])  # fmt: skip
    if env.rank == min(set(range(env.world_size)) - set(plan["dead"])):  # the first survivor (rank 0 may be new)
        died = plan["died_at"]
        lost = plan.get("lost_nodes", [])  # the nodes of the processes counted dead for their silence
        append_event(rundir.history, EVENT_REJOIN, gen=plan["gen"], dead=plan["dead"], spares=plan["spares"],
                     launch=env.launch_id, died_at=died, planned_s=round(plan["at"] - died, 3),
                     joined_s=round(time.time() - died, 3), lost_nodes=lost)  # fmt: skip
    return dataclasses.replace(booted, distributed=distributed), GroupComm(None, env.store_key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory holding config.yaml")
    parser.add_argument("--spare", type=int, default=None, help=argparse.SUPPRESS)  # job.spare_ranks: its number
    args = parser.parse_args(argv)
    rundir = RunDir(args.run_dir)
    mpi = args.spare is None and not SPAWNED
    if mpi:
        WHO.update(comm=MPI.COMM_WORLD, rank=MPI.COMM_WORLD.Get_rank())
    else:  # alone until it meets the others in its process group (a spare: until it takes a place)
        from trainer.env import spawned_rank
        from trainer.parallel.groupcomm import SoloComm

        WHO.update(comm=SoloComm(), rank=-1 - args.spare if args.spare is not None else spawned_rank(dict(os.environ)))
    clean = False
    # messages keep moving while this rank waits outside MPI
    progress = ProgressThread.start_if_needed(MPI.COMM_WORLD) if mpi else None
    try:
        status = run(rundir, WHO["comm"], progress, args.spare)
        clean = True
        return status
    except BaseException as exc:
        if WHO.get("link") is not None:  # with a keeper: this rank ends the launch (not a death to replace)
            WHO["link"].bye(b"fail")
        return _failed(rundir, exc)
    finally:
        if "torch.distributed" in sys.modules:  # nothing to tear down if torch was never imported
            from trainer.parallel.distributed import shutdown

            shutdown(WHO["comm"], clean=clean)
        if progress is not None:
            progress.stop()
        if WHO.get("link") is not None:
            WHO["link"].bye()


#: the communicator the ranks meet in now (MPI's world, then, with job.spare_ranks, their process group's) and
#: this process's rank in it: what a failure is reported and ended with
WHO: dict = {}


def _failed(rundir: RunDir, exc: BaseException) -> int:
    comm, rank = WHO["comm"], WHO["rank"]
    try:
        raise exc
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
