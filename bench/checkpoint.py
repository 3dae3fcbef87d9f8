"""Checkpoint save throughput vs raw disk bandwidth, sync vs async blocking time, and resume time.

``python bench/checkpoint.py [--ranks N] [--size-mb MB]``: the trainer's GPT and its ``Checkpointer``, built
through the trainer's own bootstrap, timed interleaved against raw disk writes, a restore and a training step
(measures and phases: bench/README.md). With ``--ranks N`` (N > 1) it starts itself under the venv's mpirun.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint_phases import Phases, instrument  # bench/checkpoint_phases.py (bench/ on sys.path)
from checkpoint_report import MEASURES, report
from common import ROOT, bench_parser, mpirun_and_env

BLOCK = 4 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--size-mb", type=float, default=300, help="checkpoint size to aim for, MB (default 300)")
    p.add_argument("--d-model", type=int, default=512, help="model width; layers are chosen to fit --size-mb")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank in a training step (default 4)")
    p.add_argument("--reps", type=int, default=9, help="timed repetitions of every measure (default 9)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
    p.add_argument("--ranks", type=int, default=1, help="world size (default 1; > 1 starts itself under mpirun)")
    p.add_argument("--dp-shard", type=int, default=1, help="parallel.dp_shard: FSDP2 shards (default 1: DDP)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--dir", type=Path, help="folder to create the temporary checkpoint folder in (default: /tmp)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or args.ranks < 1 or args.size_mb <= 0:
        p.error("need --reps >= 1, --warmup >= 0, --ranks >= 1, --size-mb > 0")
    if args.d_model % args.heads:
        p.error("--heads must divide --d-model")
    return args


def n_layers_for(size_mb: float, d_model: int, vocab: int = 257, seq_len: int = 128) -> int:
    """Layers so that parameters + AdamW's two moments (3 x 4 bytes per parameter) come closest to size_mb."""
    per_layer = 12 * d_model * d_model + 13 * d_model
    fixed = (vocab + seq_len + 2) * d_model
    return max(1, round((size_mb * 1e6 / 12 - fixed) / per_layer))


# --- worker (every rank) ----------------------------------------------------------------------------------------


def raw_write(path: Path, nbytes: int) -> None:
    """nbytes of zeros in 4 MiB writes, then fsync: ``dd if=/dev/zero bs=4M conv=fsync``."""
    buf = bytes(BLOCK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(BLOCK, left)])
        os.fsync(fd)
    finally:
        os.close(fd)


def fs_info(path: Path) -> dict:
    """The mount holding path (device, type) and whether the repository lives on the same filesystem."""
    best = ("", "?", "?")
    real = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, dev, fstype)
    return {
        "path": real,
        "mount": best[0],
        "device": best[1],
        "fstype": best[2],
        "same_filesystem_as_repo": os.stat(path).st_dev == os.stat(ROOT).st_dev,
    }


def worker(args: argparse.Namespace) -> int:
    import contextlib

    import torch
    from mpi4py import MPI

    from rundir import RunDir
    from trainer.checkpoint.state import TrainState
    from trainer.env import from_mpi
    from trainer.parallel.distributed import init_distributed, shutdown

    comm = MPI.COMM_WORLD
    env = from_mpi(comm)
    torch.set_num_threads(args.threads or env.default_threads())
    layers = n_layers_for(args.size_mb, args.d_model)
    cfg_sync, cfg_async = configs(args, env.world_size, layers)
    work = work_folder(args, comm)
    rundir = RunDir(work / "run")
    if env.rank == 0:
        rundir.create()
    comm.Barrier()

    phases = Phases()
    instrument(phases)
    d = init_distributed(env, cfg_sync.comm, torch.device("cpu"), comm)
    clean = False  # after an error nobody waits for the other ranks at shutdown
    try:
        with contextlib.ExitStack() as stack:
            parts, ckpts = build(cfg_sync, cfg_async, env, d, rundir, comm, stack)
            parts.loader.start(0)
            parts.wrapped.module.train()
            one_step = stepper(parts)
            one_step()  # AdamW's exp_avg / exp_avg_sq exist from here on
            bench = Bench(ckpts, TrainState(), one_step, phases, work, comm, env.rank, env.world_size)
            measure_reps(args, bench, parts, rundir, layers)
        clean = True
    finally:
        shutdown(comm, clean=clean)
        if env.rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def configs(args: argparse.Namespace, world: int, layers: int) -> tuple[Any, Any]:
    """The tiny config widened to ``layers`` x ``--d-model``, monitors off, for the synchronous and the
    asynchronous writer."""
    from runconfig import load_config

    overrides = [
        "job.nodes=1",
        f"job.ranks_per_node={world}",
        f"model.d_model={args.d_model}",
        f"model.n_layers={layers}",
        f"model.n_heads={args.heads}",
        f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch * world}",
        "train.eval_every=0",
        "comm.allreduce=flat",
        f"parallel.dp_shard={args.dp_shard}",
        "checkpoint.keep_last=2",
        # The monitors would only add their own work (TensorBoard files, a watchdog thread) to the timings.
        "monitor.tensorboard=false",
        "monitor.straggler_every=0",
        "monitor.hang_timeout_s=0",
    ]
    cfg_sync = load_config("tiny", [*overrides, "checkpoint.async_save=false"])
    cfg_async = load_config("tiny", [*overrides, "checkpoint.async_save=true"])
    return cfg_sync, cfg_async


def work_folder(args: argparse.Namespace, comm: Any) -> Path:
    """The temporary folder every rank works in (made by rank 0 under ``--dir``, default the temporary folder)."""
    base = None
    if comm.rank == 0:
        parent = args.dir or Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        base = tempfile.mkdtemp(prefix="bench-ckpt-", dir=parent)
    return Path(comm.bcast(base, root=0))


def build(cfg_sync: Any, cfg_async: Any, env: Any, d: Any, rundir: Any, comm: Any, stack: Any) -> tuple[Any, dict]:
    """The trainer's parts, as ``trainer.main.run`` builds them (its Checkpointer the synchronous writer), and a
    second Checkpointer on the same model and optimizer that writes asynchronously: (parts, {"sync", "async"})."""
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.loop.stop import StopFlag
    from trainer.startup.parts import build_parts

    parts = build_parts(cfg_sync, env, d, rundir, comm, StopFlag(cfg_sync.checkpoint.stop_signals), stack)
    async_ckpt = Checkpointer(
        cfg=cfg_async,
        env=env,
        rundir=rundir,
        model=parts.model,
        optimizer=parts.optimizer,
        architecture=dict(parts.recipe.architecture),
    )
    stack.callback(async_ckpt.close)
    ckpts = {"sync": parts.checkpoints, "async": async_ckpt}
    # One run directory, two writers: share what each has committed, as one trainer process would know it
    # (otherwise each prune hashes the other writer's newest generation again).
    async_ckpt.writer.verified = async_ckpt.reader.verified = ckpts["sync"].writer.verified
    return parts, ckpts


def stepper(parts: Any) -> Callable[[], None]:
    """One training step of the built parts each call (``trainer.loop.step.train_step``)."""
    from trainer.loop.step import train_step

    steps = 0

    def one_step() -> None:
        nonlocal steps
        steps += 1
        train_step(parts, steps)
        parts.mon.clock.end_step()

    return one_step


@dataclasses.dataclass
class Bench:
    """What the measures work on, on every rank; ``raw_bytes``: what a save writes (from the first generation)."""

    ckpts: dict[str, Any]  # "sync" / "async" -> Checkpointer
    state: Any  # trainer.checkpoint.state.TrainState
    one_step: Callable[[], None]
    phases: Phases
    work: Path
    comm: Any  # mpi4py.MPI.Comm
    rank: int
    world: int
    raw_bytes: int = 0

    def measure(self, name: str) -> dict:
        """Run one measure on every rank; returns the slowest rank's seconds (and the async split)."""
        from mpi4py import MPI

        self.comm.Barrier()
        self.phases.reset()
        out: dict = {}
        start = time.perf_counter()
        if name == "raw":
            path = self.work / f"raw_{self.rank:05d}.bin"
            share = self.raw_bytes // self.world + (1 if self.rank < self.raw_bytes % self.world else 0)
            raw_write(path, share)
            out["seconds"] = time.perf_counter() - start
            path.unlink()
        elif name in ("sync", "async"):
            self.state.step += 1
            self.ckpts[name].save(self.state, block=name == "sync")
            out["blocking_s"] = time.perf_counter() - start
            self.ckpts[name].wait()
            out["seconds"] = time.perf_counter() - start
        elif name == "restore":
            if not self.ckpts["sync"].restore(self.state):
                raise RuntimeError("restore found no checkpoint")
            out["seconds"] = time.perf_counter() - start
        else:
            self.one_step()
            out["seconds"] = time.perf_counter() - start
        out["phases"] = self.phases.reset()
        for key in ("seconds", "blocking_s"):
            if key in out:
                out[key] = self.comm.allreduce(out[key], op=MPI.MAX)
        return out


def first_generation(bench: Bench, rundir: Any) -> int:
    """After the first save: ``bench.raw_bytes`` (on every rank) and the number of files (rank 0; else 0) of the
    committed generation, from its manifest."""
    import json

    nfiles = 0
    if bench.rank == 0:
        newest = rundir.checkpoints / (rundir.checkpoints / "latest").read_text().strip()
        manifest = json.loads((newest / "manifest.json").read_text())
        bench.raw_bytes = sum(f["size"] for f in manifest["files"].values())
        nfiles = len(manifest["files"])
    bench.raw_bytes = bench.comm.bcast(bench.raw_bytes, root=0)
    return nfiles


def measure_reps(args: argparse.Namespace, bench: Bench, parts: Any, rundir: Any, layers: int) -> None:
    """The interleaved repetitions of every measure (every rank); rank 0 prints the report."""
    samples: dict[str, list[dict]] = {m: [] for m in MEASURES}
    wall, load_before = time.perf_counter(), os.getloadavg()
    nfiles = 0
    for rep in range(args.warmup + args.reps):
        if rep == 0:  # the size of what a save writes, from the first committed generation
            bench.measure("sync")
            nfiles = first_generation(bench, rundir)
        k = rep % len(MEASURES)
        for name in MEASURES[k:] + MEASURES[:k]:
            result = bench.measure(name)
            if rep >= args.warmup:
                samples[name].append(result)
    wall = time.perf_counter() - wall
    for ck in bench.ckpts.values():
        ck.close()  # the last async generation is committed
    if bench.rank == 0:
        run = {"nfiles": nfiles, "wall": wall, "load": [load_before[0], os.getloadavg()[0]]}
        report(describe(args, bench, parts, layers, run), samples, args.json)


def describe(args: argparse.Namespace, bench: Bench, parts: Any, layers: int, run: dict) -> dict:
    """The JSON's ``setup``: the model, the checkpoint's size, the folder, how the times are taken; ``run``: the
    generation's file count, the repetitions' wall time and the load average before and after them."""
    import torch

    n_params = sum(p.numel() for p in parts.model.parameters())
    return {
        "world_size": bench.world,
        "threads_per_rank": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "host": platform.node(),
        "torch": torch.__version__,
        "model": {"d_model": args.d_model, "n_layers": layers, "n_heads": args.heads, "params": n_params},
        "checkpoint_bytes": bench.raw_bytes,
        "checkpoint_files": run["nfiles"],
        "batch_per_rank": args.batch,
        "seq_len": parts.cfg.model.seq_len,
        "reps": args.reps,
        "warmup_reps": args.warmup,
        "dir": fs_info(bench.work),
        "raw_write": "one file per rank, 4 MiB os.write blocks of zeros, fsync (= dd bs=4M conv=fsync)",
        "timing": "per repetition the slowest rank; medians over repetitions; order rotates per repetition",
        "phases": "rank 0, seconds inside wrapped functions; bg: = on the background checkpoint thread",
        "restore_cache": "warm: the generation was just written and is in the page cache",
        "measure_wall_s": run["wall"],
        "loadavg_1min_before_after": run["load"],
    }


# --- launcher ---------------------------------------------------------------------------------------------------


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    found = mpirun_and_env(per_node=args.ranks, threads=args.threads or max(1, (os.cpu_count() or 1) // args.ranks))
    if found is None:
        return 2
    mpirun, env = found
    rest = [a for a in argv if a != "--worker"]
    if args.json:
        rest += [f"--json={args.json.resolve()}"]
    cmd = [str(mpirun), "-n", str(args.ranks), sys.executable, "-u", str(Path(__file__).resolve()), "--worker", *rest]
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    start = time.perf_counter()
    under_mpirun = int(os.environ.get("PMI_SIZE", "1")) > 1
    status = worker(args) if args.worker or args.ranks == 1 or under_mpirun else launch(args, argv)
    if args.worker or under_mpirun:
        return status
    print(f"(wall time {time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
