"""Trainer entry point, started once per rank (by mpirun or srun): ``python -m trainer --run-dir DIR``.

Bootstrap order: config -> MPI environment -> data -> process groups -> model -> preflight -> loop -> summary.
User errors stop every rank with one message (written to ``failure.json`` for the launcher) and exit status 2; the
process group is destroyed and files are closed on every path.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # before the heavy imports: a launch's start-up cost counts from here

import gc  # noqa: E402

# Start-up's imports (torch, DCP with DTensor, torch._dynamo: some 2,200 modules and 290,000 long-lived objects)
# run with the cyclic garbage collector off: they leave nothing to collect, yet set off full collections that walk
# everything imported so far (measured here: 5 of them, 0.4 s of a 2.3 s import; with 4 ranks on 2 cores the
# slowest rank's imports went from 4.6 to 3.8 s). ``_collector_back_on`` turns it on again.
gc.disable()

from trainer.loop.stop import EarlySignals  # noqa: E402

# A stop signal during the imports or MPI_Init is recorded, not fatal: the run stops cleanly at its first step.
EARLY_SIGNALS = EarlySignals()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

from trainer.parallel.mpi_library import apply_defaults  # noqa: E402

MPI_DEFAULTS = apply_defaults()  # before MPI starts: the MPI library reads these at MPI_Init

from mpi4py import MPI  # noqa: E402

from runconfig import ConfigError, RunDir, load_config  # noqa: E402
from runconfig.contract import (  # noqa: E402
    EVENT_DONE,
    EVENT_RESUME,
    EVENT_START,
    EVENT_STOPPED,
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    FAILURE_CRASH,
    FAILURE_STRAGGLER,
    FAILURE_USER,
    append_event,
    write_json_atomic,
)
from runconfig.load import config_hash  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.parallel.mpi_progress import ProgressThread  # noqa: E402

log = logging.getLogger("trainer")


def setup_logging(rundir: RunDir, rank: int) -> None:
    fmt = logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    handlers: list[logging.Handler] = []
    if rundir.logs.is_dir():
        handlers.append(logging.FileHandler(rundir.rank_log(rank)))
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        if sys.stdout.isatty():  # a progress bar is drawn there instead of the periodic step lines
            console.addFilter(lambda record: not getattr(record, "progress", False))
        handlers.append(console)
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)


def run(rundir: RunDir, comm: MPI.Comm, progress: ProgressThread | None = None) -> int:
    """Train to the configured step count; return the exit status (0 done, EXIT_STOPPED stopped by a signal).

    Bootstrap: config and code snapshot -> MPI environment -> process groups -> the parts (recipe, data, model,
    monitors, checkpointer: ``trainer.build``) -> restore -> gang preflight -> loop -> summary. Everything built is
    closed on every path (an ExitStack)."""
    # Imported here so that `--help` and config errors do not pay for importing torch.
    import torch

    from runconfig import code, shm
    from trainer.build import build_parts, check_overlap, plan_allreduce, restore_or_start
    from trainer.checkpoint.fingerprint import params_sha256
    from trainer.env import agree, from_mpi
    from trainer.loop.stop import StopFlag
    from trainer.loop.stopreport import LeadCheck, record_signal_path, stopped_fields
    from trainer.loop.train import train
    from trainer.observe.hostmem import fix_mmap_threshold
    from trainer.observe.memory import state_bytes
    from trainer.observe.metrics import truncate_metrics
    from trainer.observe.preflight import run_preflight
    from trainer.observe.stragglers import NodeEvicted
    from trainer.observe.timing import peak_memory_mb
    from trainer.parallel.distributed import gloo_threads, init_distributed, pick_device

    # DDP's constructor imports torch._dynamo (1.5-3 s on a loaded 2-core host): import it in the background while
    # this thread reads the config and the MPI layout and meets the other ranks, which import nothing; joined before
    # the parts are built. Never beside this thread's own imports: two threads importing torch's packages at once
    # can each find the other's module half-initialised (seen: "cannot import name '_FSDPDeviceHandle' from
    # partially initialized module 'torch.distributed.fsdp._common_utils'" on one rank of a Slurm test).
    importer = threading.Thread(target=_import_quietly, args=("torch._dynamo",), daemon=True)
    importer.start()
    # Where a launch's start-up goes (rank 0's clock; "imports" is the slowest rank's), in the start/resume event.
    marks = {"imports": time.time()}
    try:  # deterministic checks: every rank fails the same way
        cfg = load_config(str(rundir.config))
        code_sha256 = code.activate(rundir)  # the recipe's code as submitted, first on sys.path
        env = from_mpi(comm)
    except (ConfigError, UserError) as exc:
        raise UserError(str(exc), collective=True) from None
    slowest_imports = comm.allreduce(marks["imports"] - PROCESS_START, op=MPI.MAX)
    marks["mpi"] = time.time()
    agree(comm, rundir.writable_error() if env.rank == 0 else None)
    setup_logging(rundir, env.rank)
    fix_mmap_threshold(cfg.train.host_mmap_threshold_kb)  # before the model and data take memory
    # A signal during start-up (from the process's first lines on) is honoured at step 1.
    stop = StopFlag(cfg.checkpoint.stop_signals, early=EARLY_SIGNALS)
    if stop.signum is not None:
        log.info("stop signal %d arrived during start-up: the run stops at its first step boundary", stop.signum)
    if stop.ignored_early is not None:
        log.warning(
            "signal %d arrived during start-up; it is not in checkpoint.stop_signals: ignored", stop.ignored_early
        )
    torch.set_num_threads(cfg.job.threads_per_rank or env.default_threads())
    log.info(
        "rank %d/%d on %s%s: node %d local rank %d%s, %d threads, pid %d",
        env.rank,
        env.world_size,
        env.hostname,
        f" (slurm node {env.slurm_node})" if env.slurm_node else "",
        env.node,
        env.local_rank,
        " (simulated nodes)" if env.simulated_nodes else "",
        torch.get_num_threads(),
        os.getpid(),
    )
    record_signal_path(rundir, env, cfg.checkpoint.stop_signals, EARLY_SIGNALS)  # for `python -m hpc selftest`
    if env.host_local_rank == 0:  # what ranks of an earlier, killed launch left on this host
        removed = shm.sweep()
        if removed:
            log.info("removed %d stale MPI shared-memory segment(s) from %s", len(removed), shm.SHM_DIR)
    if env.rank == 0 and MPI_DEFAULTS:
        applied = " ".join(f"{name}={value}" for name, value in MPI_DEFAULTS.items())
        log.info("MPI library defaults applied (set them in job.env to choose otherwise): %s", applied)
    device = pick_device(env, cfg.train.device)
    d = init_distributed(env, cfg.comm, device, comm)
    marks["rendezvous"] = time.time()
    importer.join()
    _collector_back_on()
    with contextlib.ExitStack() as stack:
        memory: dict[str, float] = {}
        p = build_parts(cfg, env, d, rundir, comm, stop, stack, code_sha256=code_sha256, marks=marks, memory=memory)
        marks["build"] = time.time()
        resumed = restore_or_start(p)
        plan_allreduce(p, rundir)  # comm.allreduce=auto: after the restore, which may hold the plan to reuse
        check_overlap(p)  # the overlapped reduction against the synchronous one, on the plan's sizes
        marks["restore"] = time.time()
        if not run_preflight(p, comm, rundir):  # a node named, monitor.preflight: exclude (in failure.json)
            return EXIT_FAILED  # every rank: all judged the same gathered figures; the normal teardown follows
        marks["preflight"] = time.time()
        if p.wrapped.dispatch is None:  # no hook reduces with the hierarchy's groups: start-up was their last use
            began = time.perf_counter()
            released = d.groups.release()
            if env.rank == 0 and released:
                log.info(
                    "released %d process group(s) used only at start-up (no hook reduces with them); gloo threads "
                    "left in this process: %d (%.3f s)",
                    released,
                    gloo_threads(),
                    time.perf_counter() - began,
                )
        state = p.state
        memory["startup"] = peak_memory_mb(d.device)  # the throw-away step and the restore included
        memory = _largest(comm, memory, float)
        if env.rank == 0:
            # Steps after the checkpoint are recomputed: their records move to metrics.discarded.jsonl.
            discarded = truncate_metrics(rundir.metrics, state.step, rundir.metrics_discarded)
            resume_fields = {"skipped_checkpoints": p.checkpoints.skipped, "discarded_records": discarded}
            append_event(
                rundir.history,
                EVENT_RESUME if resumed else EVENT_START,
                step=state.step,
                world_size=env.world_size,
                nodes=[env.node_names[env.topology.node_ranks(n)[0]] for n in range(env.topology.num_nodes)],
                grad_accum=cfg.grad_accum(env.world_size),
                slurm_job_id=env.slurm_job_id,
                slurm_restart_count=env.slurm_restart_count,
                launch=env.launch_id,
                process_start=PROCESS_START,
                startup_s=_startup(marks, slowest_imports),
                peak_mem_mb={k: round(v, 1) for k, v in memory.items()},  # the largest rank's
                recipe=cfg.recipe,
                code_sha256=code_sha256,
                **(resume_fields if resumed else {}),
            )
        n_params = p.wrapped.n_params
        log.info(
            "recipe %s: %s with %d parameters; train %d samples, eval %s",
            cfg.recipe,
            type(p.model).__name__,
            n_params,
            len(p.recipe.train_data),
            len(p.recipe.eval_data) if p.recipe.eval_data is not None else "none",
        )
        relaxed = progress.relaxed() if progress is not None else contextlib.nullcontext()
        try:
            with relaxed:  # no MPI message while the loop trains: its progress thread wakes less often
                stopped = train(p, LeadCheck(cfg.job.signal_lead_s, rundir, env), _profiler(cfg, env, d.device, rundir))
        except NodeEvicted as evicted:  # every rank, after a committed checkpoint: leave the slow node out
            p.mon.watchdog.close()
            p.checkpoints.close()
            info = evicted.info
            node = env.node_names[info["ranks"][0]]
            message = (
                f"node {info['node']} ({node}) was a straggler in {info['checks']} straggler checks in a row "
                f"(busy {info['step_time_s']:.3f} s/step, {info['ratio']:.2f}x the median node; "
                f"monitor.straggler_exclude_after={cfg.monitor.straggler_exclude_after}); checkpoint committed at "
                f"step {state.step}, the launch ends so that the launcher leaves the node out"
            )
            if env.rank == 0:
                log.error("%s", message)
                why = f"straggler: {info['ratio']:.2f}x the median node in {info['checks']} checks in a row"
                _report_failure(rundir, 0, message, FAILURE_STRAGGLER, [env.suspect(r, why) for r in info["ranks"]])
            return EXIT_FAILED
        except RuntimeError as exc:  # a collective failed (a peer's connection closed): name who went away
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            diagnosis, suspects = p.mon.watchdog.diagnose(exc)
            message = f"rank {env.rank}: a collective failed at step {state.step + 1}{diagnosis}. The error: {first}"
            _report_failure(rundir, env.rank, message, FAILURE_CRASH, suspects)  # first: see _report_failure
            log.error("%s", message)
            raise
        p.mon.watchdog.close()
        p.checkpoints.close()  # a background save is committed before anything else happens
        if stopped is not None:
            fields = stopped_fields(comm, env, stop, stopped, cfg.job.signal_lead_s)  # collective
            if env.rank == 0:
                append_event(rundir.history, EVENT_STOPPED, step=state.step, launch=env.launch_id, **fields)
            return EXIT_STOPPED
        summary = {
            "final_step": state.step,
            "final_loss": state.last_loss,
            "final_eval_loss": state.last_eval_loss,
            "tokens_seen": state.tokens_seen,
            "unit": p.recipe.unit,
            "wall_time_s": state.elapsed_s,
            "params_sha256": params_sha256(p.model, skip=p.wrapped.aliases),
            "n_params": n_params,
            "recipe": cfg.recipe,
            "code_sha256": code_sha256,
            "world_size": env.world_size,
            "topology": env.topology.describe(),
            "allreduce": p.allreduce,
            "allreduce_plan": state.allreduce_plan,
            "parallel": p.wrapped.layout.sizes(),
            "state_bytes_per_rank": _largest(comm, state_bytes(p.model, p.optimizer)),
            "backend": d.backend,
            "config_sha256": config_hash(cfg),
            **p.mon.stragglers.summary(),
        }
        if env.rank == 0:
            write_json_atomic(rundir.summary, summary)
            append_event(rundir.history, EVENT_DONE, step=state.step, launch=env.launch_id)
            log.info(
                "done: step %d loss %.4f params_sha256 %s", state.step, state.last_loss, summary["params_sha256"][:16]
            )
        return EXIT_DONE
        # The stop handlers stay (they only set a flag) until the process ends: a stop signal arriving during the
        # teardown, after the decision is recorded, must not kill a rank with the default action.


def _largest(comm, values: dict, kind: type = int) -> dict:
    """Each entry's largest value over the ranks (collective)."""
    return {k: kind(comm.allreduce(v, op=MPI.MAX)) for k, v in values.items()}


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
            _report_failure(rundir, rank if exc.rank is None else exc.rank, str(exc), FAILURE_USER)
        if not exc.collective and comm.Get_size() > 1:
            # Only this rank stopped (say, on a corrupt window it read mid-training): the others may be blocked in
            # a collective waiting for it. End every rank now with the user-error status, the report written.
            _abort_job(comm, EXIT_USER_ERROR)
        _meet(comm)
        return EXIT_USER_ERROR
    except OSError as exc:
        # Storage that kept failing past its retries (runconfig/ioretry.py): a crash, restarted in the job. One that
        # every rank raised (a checkpoint's GaveUp) is reported by rank 0 and ends every rank without an abort.
        collective = getattr(exc, "collective", False)
        if rank == 0 or not collective:
            text = str(exc) if collective else f"rank {rank}: {str(exc).splitlines()[0][:300]}"
            notes = "; ".join(getattr(exc, "__notes__", []))
            _report_failure(rundir, rank, f"{text} ({notes})" if notes else text, FAILURE_CRASH)  # before any output
            traceback.print_exc()
        if not collective:
            _abort_job(comm, EXIT_FAILED)
        return EXIT_FAILED
    except Exception as exc:
        # Anything else (a collective failed because a peer went away, a bug): the other ranks may be blocked
        # in a collective, or in MPI_Finalize's barrier waiting for a rank that is gone. Abort the whole MPI job
        # so the launcher ends every rank at once; failure.json (the exception and where) and the traceback first.
        _report_failure(rundir, rank, _describe(rank, exc), FAILURE_CRASH)
        traceback.print_exc()
        _abort_job(comm, EXIT_FAILED)
        raise  # not reached
    finally:
        if "torch.distributed" in sys.modules:  # nothing to tear down if torch was never imported
            from trainer.parallel.distributed import shutdown

            shutdown(comm, clean=clean)
        if progress is not None:
            progress.stop()


def _meet(comm: MPI.Comm, timeout_s: float = 30.0) -> None:
    """Wait, at most ``timeout_s``, until every rank has reached the same (collective) error. A rank that found it
    first (rank 0 checks a checkpoint's sizes alone; MPI's broadcast does not wait for the receivers) would
    otherwise leave while slower ranks are still building their process groups with it, and they would fail there
    ("Connection closed by peer") and end the job with a crash's status instead of the user error's."""
    if comm.Get_size() > 1:
        from trainer.env import patient_barrier

        patient_barrier(comm, poll_s=0.005, timeout_s=timeout_s)


def _abort_job(comm: MPI.Comm, status: int) -> None:
    """End every rank of the MPI job with ``status``, after flushing what this rank has written."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    comm.Abort(status)


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


def _startup(marks: dict[str, float], slowest_imports: float) -> dict[str, float]:
    """Seconds per start-up phase: process start -> imports done (slowest rank) -> MPI environment -> process
    groups -> recipe built (its data opened and checked) -> model wrapped, checks, monitors -> checkpoint restored."""
    out = {"imports": round(slowest_imports, 3)}
    names, times = list(marks), list(marks.values())
    for name, before, after in zip(names[1:], times, times[1:], strict=False):
        out[name] = round(after - before, 3)
    return out


def _profiler(cfg, env, device, rundir: RunDir):
    """monitor.profile_steps: a StepProfiler writing into RUN_DIR/profile/, else None."""
    span = cfg.monitor.profile_range()
    if span is None:
        return None
    from trainer.observe.profile import StepProfiler

    return StepProfiler(*span, device, rundir.root / "profile", env.rank)


def _describe(rank: int, exc: BaseException) -> str:
    """``rank R: Type: first line of the message (at file:line in function)``: the innermost frame, for a
    diagnosis that says where a bug was hit without the whole traceback."""
    text = str(exc).strip().splitlines()
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        f = frames[-1]
        try:
            name = str(Path(f.filename).resolve().relative_to(Path(__file__).resolve().parent.parent))
        except ValueError:
            name = f.filename
        where = f" (at {name}:{f.lineno} in {f.name})"
    return f"rank {rank}: {type(exc).__name__}: {text[0][:300] if text else ''}{where}"


def _report_failure(rundir: RunDir, rank: int, message: str, kind: str, suspects: list[dict] | None = None) -> None:
    """failure.json, then the message on stderr. In that order: once a rank of the MPI job has ended, MPICH's
    hydra ends every other rank the moment any of them writes to stdout or stderr (measured with mpirun
    -disable-auto-cleanup: a survivor's first line after a rank's SIGKILL), so a report printed first was lost
    with the rank that was writing it and the launcher restarted with "no diagnosis recorded"."""
    if rundir.root.is_dir():
        with contextlib.suppress(OSError):
            rundir.write_failure(rank, message, kind, suspects)
    print(f"error: {message}", file=sys.stderr, flush=True)
