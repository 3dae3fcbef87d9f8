"""Trainer entry point, started once per rank (by mpirun or srun): ``python -m trainer --run-dir DIR``.

Bootstrap order: config -> MPI environment -> data -> process groups -> model -> loop -> summary. User errors
stop every rank with one message (written to ``failure.json`` for the launcher) and exit status 2; the process
group is destroyed and files are closed on every path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path

from mpi4py import MPI

from runconfig import ConfigError, RunDir, load_config
from runconfig.load import config_hash
from trainer.errors import UserError

EXIT_USER_ERROR = 2
EXIT_STOPPED = 75  # stopped by a signal with a committed checkpoint: resumable (EX_TEMPFAIL)
log = logging.getLogger("trainer")


def setup_logging(rundir: RunDir, rank: int) -> None:
    fmt = logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    handlers: list[logging.Handler] = []
    if rundir.logs.is_dir():
        handlers.append(logging.FileHandler(rundir.rank_log(rank)))
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)


def run(rundir: RunDir, comm: MPI.Comm) -> int:
    """Train to the configured step count; return the exit status (0 done, EXIT_STOPPED stopped by a signal)."""
    # Imported here so that `--help` and config errors do not pay for importing torch.
    import torch

    from trainer.checkpoint import Checkpointer
    from trainer.data.resolve import open_splits
    from trainer.distributed import init_distributed, pick_device
    from trainer.env import agree, from_mpi
    from trainer.fingerprint import params_sha256
    from trainer.loop import TrainState, build, train
    from trainer.metrics import MetricsWriter, append_event, truncate_metrics, write_json_atomic
    from trainer.stop import StopFlag

    try:  # deterministic checks: every rank fails the same way
        cfg = load_config(str(rundir.config))
        env = from_mpi(comm)
    except (ConfigError, UserError) as exc:
        raise UserError(str(exc), collective=True) from None
    agree(comm, rundir.writable_error() if env.rank == 0 else None)
    setup_logging(rundir, env.rank)
    stop = StopFlag(cfg.checkpoint.stop_signals)  # early: a signal during start-up is honoured at step 1
    torch.set_num_threads(cfg.job.threads_per_rank or env.default_threads())
    log.info(
        "rank %d/%d on %s%s: node %d local rank %d%s, %d threads",
        env.rank,
        env.world_size,
        env.hostname,
        f" (slurm node {env.slurm_node})" if env.slurm_node else "",
        env.node,
        env.local_rank,
        " (simulated nodes)" if env.simulated_nodes else "",
        torch.get_num_threads(),
    )
    train_data, val_data = open_splits(cfg.data, cfg.model.seq_len, cfg.model.vocab_size, env, comm)
    device = pick_device(env, cfg.train.device)
    d = init_distributed(env, cfg.comm, device, comm)
    checkpoints = metrics = None
    try:
        comps = build(cfg, env, d)
        checkpoints = Checkpointer(cfg=cfg, env=env, rundir=rundir, comps=comps, comm=comm)
        state = TrainState()
        resumed = cfg.checkpoint.resume and checkpoints.restore(state)
        if env.rank == 0:
            truncate_metrics(rundir.metrics, state.step)  # steps after the checkpoint are recomputed
            append_event(
                rundir.history,
                {
                    "event": "resume" if resumed else "start",
                    "step": state.step,
                    "world_size": env.world_size,
                    "slurm_job_id": env.slurm_job_id,
                    "slurm_restart_count": env.slurm_restart_count,
                },
            )
        metrics = MetricsWriter(rundir.metrics, enabled=env.rank == 0)
        n_params = sum(p.numel() for p in comps.model.parameters())
        log.info("model: %d parameters; train %d windows, val %d windows", n_params, len(train_data), len(val_data))
        stopped = train(cfg, env, d, comps, train_data, val_data, state, metrics, checkpoints, stop)
        checkpoints.close()  # a background save is committed before anything else happens
        if stopped:
            if env.rank == 0:
                append_event(rundir.history, {"event": "stopped", "step": state.step, "signal": stop.signum})
            return EXIT_STOPPED
        summary = {
            "final_step": state.step,
            "final_loss": state.last_loss,
            "final_eval_loss": state.last_eval_loss,
            "tokens_seen": state.tokens_seen,
            "wall_time_s": state.elapsed_s,
            "params_sha256": params_sha256(comps.model),
            "n_params": n_params,
            "world_size": env.world_size,
            "topology": env.topology.describe(),
            "allreduce": cfg.comm.allreduce,
            "backend": d.backend,
            "config_sha256": config_hash(cfg),
        }
        if env.rank == 0:
            write_json_atomic(rundir.summary, summary)
            append_event(rundir.history, {"event": "done", "step": state.step})
            log.info(
                "done: step %d loss %.4f params_sha256 %s", state.step, state.last_loss, summary["params_sha256"][:16]
            )
        return 0
    finally:
        if checkpoints is not None:
            checkpoints.close()
        if metrics is not None:
            metrics.close()
        stop.restore()
        train_data.close()
        val_data.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory holding config.yaml")
    args = parser.parse_args(argv)
    rundir = RunDir(args.run_dir)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    clean = False
    try:
        status = run(rundir, comm)
        clean = True
        return status
    except UserError as exc:
        if rank == 0 or not exc.collective:
            _report_failure(rundir, rank, str(exc))
        return EXIT_USER_ERROR
    finally:
        if "torch.distributed" in sys.modules:  # nothing to tear down if torch was never imported
            from trainer.distributed import shutdown

            shutdown(comm, clean=clean)


def _report_failure(rundir: RunDir, rank: int, message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    if rundir.root.is_dir():
        with contextlib.suppress(OSError):
            rundir.failure.write_text(json.dumps({"rank": rank, "message": message}) + "\n")
