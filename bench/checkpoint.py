"""Checkpoint save throughput vs raw disk bandwidth, sync vs async blocking time, and resume time.

``python bench/checkpoint.py`` builds the trainer's GPT (``tiny`` config, widened so that model + AdamW state is
about ``--size-mb``) through the trainer's own bootstrap (``from_mpi``, ``init_distributed``, then
``trainer.build.build_parts``: recipe, DDP, loader, optimizer, monitors and its ``Checkpointer``, as
``trainer.main.run`` does; a second ``Checkpointer`` on the same model and optimizer writes asynchronously) and
times, interleaved repetition by repetition (the order rotates, so machine noise hits every measure alike), in one
temporary folder:

- ``raw``: writing the checkpoint's byte count to one file in 4 MiB blocks + fsync (what ``dd bs=4M conv=fsync``
  does), split evenly over the ranks;
- ``sync``: ``Checkpointer.save(block=True)`` with checkpoint.async_save=false (DCP write, per-file SHA-256,
  manifest commit, prune);
- ``async``: ``Checkpointer.save(block=False)`` with checkpoint.async_save=true: the time the caller is blocked,
  then ``wait()`` until the background thread committed (so two writes never overlap);
- ``restore``: ``Checkpointer.restore()`` of the newest generation (SHA-256 of every file, DCP load,
  set_state_dict);
- ``step``: one training step of the same model: ``trainer.loop.step.train_step`` (the loader's next batch,
  forward, backward, clipping, AdamW step).

Each figure is the slowest rank's time; the tables show medians over repetitions. Where the time goes is measured
by timing wrappers around the functions the checkpointer's modules call (trainer/checkpoint/: the checkpointer
facade, writer, reader, agreement; rank 0's view).
With ``--ranks N`` (N > 1) the
script starts itself under the venv's mpirun with HPC_SIMULATE_RANKS_PER_NODE=N. Prints a table and a JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import ROOT, mpirun_and_env  # bench/common.py (scripts run from bench/ on sys.path)

sys.path.insert(0, str(ROOT))

MEASURES = ("raw", "sync", "async", "restore", "step")
BLOCK = 4 << 20
TARGET_SAVE_OVER_RAW = 0.5
TARGET_ASYNC_BLOCKING = 0.1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    p.add_argument("--json", type=Path, help="also write the JSON result to this file")
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


# --- timing of the phases inside trainer.checkpoint.checkpointer -----------------------------------------------


class Phases:
    """Seconds spent in wrapped functions, per phase; calls on the checkpoint thread are prefixed ``bg:``.

    A wrapped function calling itself (or another call of the same phase) counts once, at the outermost call.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = {}
        self.local = threading.local()

    def reset(self) -> dict[str, float]:
        with self.lock:
            out, self.seconds = self.seconds, {}
        return out

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:  # the checkpointer's code has moved: instrument() must follow it
            name = getattr(owner, "__name__", type(owner).__name__)
            raise RuntimeError(f"bench/checkpoint.py: {name} has no {attr} to time as {phase}; update instrument()")

        @functools.wraps(fn)
        def timed(*a: Any, **kw: Any) -> Any:
            active: set[str] = self.local.__dict__.setdefault("active", set())
            if phase in active:
                return fn(*a, **kw)
            active.add(phase)
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                elapsed = time.perf_counter() - start
                active.discard(phase)
                key = ("bg:" if threading.current_thread().name.startswith("ckpt") else "") + phase
                with self.lock:
                    self.seconds[key] = self.seconds.get(key, 0.0) + elapsed

        setattr(owner, attr, timed)


def instrument(phases: Phases) -> None:
    """Wrap what the checkpointer's modules call (their module globals only; torch itself is not patched): the
    facade trainer.checkpoint.checkpointer (the state dict, the CPU copy of an async save, a sharded model's
    fingerprint), writer.py (DCP's save, the digests, fsyncs, commit, prune), reader.py (verification, DCP's load,
    set_state_dict) and the ranks' agreement on every phase (agreement.py)."""
    import torch.distributed.checkpoint as dcp

    import rundir.checkpoints as layout
    import trainer.checkpoint.agreement as agreement
    import trainer.checkpoint.checkpointer as ck
    import trainer.checkpoint.reader as reader
    import trainer.checkpoint.writer as writer

    for module in (writer, reader):  # their own copy of torch.distributed.checkpoint's names, to wrap in place
        module.dcp = types.SimpleNamespace(**{k: getattr(dcp, k) for k in dir(dcp) if not k.startswith("_")})
    for owner, attr, phase in [
        (writer.dcp, "save", "dcp_save"),
        (reader.dcp, "load", "dcp_load"),
        (ck, "get_state_dict", "get_state_dict"),
        (reader, "get_state_dict", "get_state_dict"),
        (ck, "stage", "stage_cpu_copy"),
        (ck, "params_sha256", "params_sha256"),
        (writer, "tensors_sha256", "params_sha256"),
        (reader, "params_sha256", "params_sha256"),
        (writer, "sha256_file", "sha256_files"),
        (writer, "fsync_all_dirs", "fsync_dirs"),
        (writer, "commit", "commit_manifest"),
        (writer, "prune", "prune"),
        (reader, "set_state_dict", "set_state_dict"),
        (reader, "sha256_file", "sha256_verify"),  # each rank's share of the files, on restore
        (layout, "sha256_file", "sha256_verify"),  # validate() on restore
        (agreement.Agreement, "gather", "agree_collective"),
        (agreement.Agreement, "from_rank0", "agree_collective"),
    ]:
        phases.wrap(owner, attr, phase)


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

    from runconfig import load_config
    from rundir import RunDir
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.state import TrainState
    from trainer.env import from_mpi
    from trainer.loop.step import train_step
    from trainer.loop.stop import StopFlag
    from trainer.parallel.distributed import init_distributed, shutdown
    from trainer.startup.parts import build_parts

    comm = MPI.COMM_WORLD
    env = from_mpi(comm)
    world, rank = env.world_size, env.rank
    torch.set_num_threads(args.threads or env.default_threads())
    layers = n_layers_for(args.size_mb, args.d_model)
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

    base = None
    if rank == 0:
        parent = args.dir or Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        base = tempfile.mkdtemp(prefix="bench-ckpt-", dir=parent)
    work = Path(comm.bcast(base, root=0))
    rundir = RunDir(work / "run")
    if rank == 0:
        rundir.create()
    comm.Barrier()

    phases = Phases()
    instrument(phases)
    d = init_distributed(env, cfg_sync.comm, torch.device("cpu"), comm)
    clean = False  # after an error nobody waits for the other ranks at shutdown
    try:
        with contextlib.ExitStack() as stack:
            parts = build_parts(cfg_sync, env, d, rundir, comm, StopFlag(cfg_sync.checkpoint.stop_signals), stack)
            async_ckpt = Checkpointer(
                cfg=cfg_async,
                env=env,
                rundir=rundir,
                model=parts.model,
                optimizer=parts.optimizer,
                comm=comm,
                architecture=dict(parts.recipe.architecture),
            )
            stack.callback(async_ckpt.close)
            ckpts = {"sync": parts.checkpoints, "async": async_ckpt}
            # One run directory, two writers: share what each has committed, as one trainer process would know it
            # (otherwise each prune hashes the other writer's newest generation again).
            async_ckpt.writer.verified = async_ckpt.reader.verified = ckpts["sync"].writer.verified
            state = TrainState()
            parts.loader.start(0)
            parts.wrapped.module.train()
            steps = 0

            def one_step() -> None:
                nonlocal steps
                steps += 1
                train_step(parts, steps)
                parts.mon.clock.end_step()

            one_step()  # AdamW's exp_avg / exp_avg_sq exist from here on
            measure_reps(args, parts, ckpts, state, one_step, phases, work, rundir, comm, layers)
        clean = True
    finally:
        shutdown(comm, clean=clean)
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def measure_reps(
    args: argparse.Namespace,
    parts: Any,  # trainer.loop.parts.Parts
    ckpts: dict[str, Any],  # "sync" / "async" -> Checkpointer
    state: Any,  # trainer.checkpoint.state.TrainState
    one_step: Callable[[], None],
    phases: Phases,
    work: Path,
    rundir: Any,  # runconfig.RunDir
    comm: Any,  # mpi4py.MPI.Comm
    layers: int,
) -> None:
    """The interleaved repetitions of every measure (every rank); rank 0 prints the report."""
    import torch
    from mpi4py import MPI

    rank, world = parts.env.rank, parts.env.world_size
    seq = parts.cfg.model.seq_len
    raw_bytes = nfiles = 0  # set from the first committed generation

    def measure(name: str) -> dict:
        """Run one measure on every rank; returns the slowest rank's seconds (and the async split)."""
        comm.Barrier()
        phases.reset()
        out: dict = {}
        start = time.perf_counter()
        if name == "raw":
            path = work / f"raw_{rank:05d}.bin"
            share = raw_bytes // world + (1 if rank < raw_bytes % world else 0)
            raw_write(path, share)
            out["seconds"] = time.perf_counter() - start
            path.unlink()
        elif name in ("sync", "async"):
            state.step += 1
            ckpts[name].save(state, block=name == "sync")
            out["blocking_s"] = time.perf_counter() - start
            ckpts[name].wait()
            out["seconds"] = time.perf_counter() - start
        elif name == "restore":
            if not ckpts["sync"].restore(state):
                raise RuntimeError("restore found no checkpoint")
            out["seconds"] = time.perf_counter() - start
        else:
            one_step()
            out["seconds"] = time.perf_counter() - start
        out["phases"] = phases.reset()
        for key in ("seconds", "blocking_s"):
            if key in out:
                out[key] = comm.allreduce(out[key], op=MPI.MAX)
        return out

    samples: dict[str, list[dict]] = {m: [] for m in MEASURES}
    wall, load_before = time.perf_counter(), os.getloadavg()
    for rep in range(args.warmup + args.reps):
        if rep == 0:  # the size of what a save writes, from the first committed generation
            measure("sync")
            if rank == 0:
                newest = rundir.checkpoints / (rundir.checkpoints / "latest").read_text().strip()
                manifest = json.loads((newest / "manifest.json").read_text())
                raw_bytes = sum(f["size"] for f in manifest["files"].values())
                nfiles = len(manifest["files"])
            raw_bytes = comm.bcast(raw_bytes, root=0)
        k = rep % len(MEASURES)
        for name in MEASURES[k:] + MEASURES[:k]:
            result = measure(name)
            if rep >= args.warmup:
                samples[name].append(result)
    wall = time.perf_counter() - wall
    for ck in ckpts.values():
        ck.close()  # the last async generation is committed
    if rank == 0:
        n_params = sum(p.numel() for p in parts.model.parameters())
        setup = {
            "world_size": world,
            "threads_per_rank": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "host": platform.node(),
            "torch": torch.__version__,
            "model": {"d_model": args.d_model, "n_layers": layers, "n_heads": args.heads, "params": n_params},
            "checkpoint_bytes": raw_bytes,
            "checkpoint_files": nfiles,
            "batch_per_rank": args.batch,
            "seq_len": seq,
            "reps": args.reps,
            "warmup_reps": args.warmup,
            "dir": fs_info(work),
            "raw_write": "one file per rank, 4 MiB os.write blocks of zeros, fsync (= dd bs=4M conv=fsync)",
            "timing": "per repetition the slowest rank; medians over repetitions; order rotates per repetition",
            "phases": "rank 0, seconds inside wrapped functions; bg: = on the background checkpoint thread",
            "restore_cache": "warm: the generation was just written and is in the page cache",
            "measure_wall_s": wall,
            "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
        }
        report(setup, samples, args.json)


# --- report (rank 0) --------------------------------------------------------------------------------------------


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


def report(setup: dict, samples: dict[str, list[dict]], json_path: Path | None) -> None:
    nbytes = setup["checkpoint_bytes"]
    t = {m: summarize([s["seconds"] for s in samples[m]]) for m in MEASURES}
    t["async_blocking"] = summarize([s["blocking_s"] for s in samples["async"]])
    t["sync_blocking"] = summarize([s["blocking_s"] for s in samples["sync"]])
    med = {k: v["median"] for k, v in t.items()}
    gbps = {k: nbytes / med[k] / 1e9 for k in ("raw", "sync", "async", "restore")}
    results = {
        "raw_write_s": t["raw"],
        "raw_write_GBps": gbps["raw"],
        "sync_save_s": t["sync"],
        "sync_save_GBps": gbps["sync"],
        "save_over_raw": gbps["sync"] / gbps["raw"],
        "sync_blocking_s": t["sync_blocking"],
        "async_blocking_s": t["async_blocking"],
        "async_blocking_over_sync_save": med["async_blocking"] / med["sync"],
        "async_blocking_over_step": med["async_blocking"] / med["step"],
        "sync_blocking_over_step": med["sync"] / med["step"],
        "async_total_s": t["async"],
        "async_total_GBps": gbps["async"],
        "restore_s": t["restore"],
        "restore_GBps": gbps["restore"],
        "step_s": t["step"],
    }
    targets = {
        "save_over_raw": {
            "target": f">= {TARGET_SAVE_OVER_RAW}",
            "met": results["save_over_raw"] >= TARGET_SAVE_OVER_RAW,
        },
        "async_blocking_over_sync_save": {
            "target": f"<= {TARGET_ASYNC_BLOCKING}",
            "met": results["async_blocking_over_sync_save"] <= TARGET_ASYNC_BLOCKING,
        },
    }
    phase_cols = ("sync", "async", "restore")
    phases: dict[str, dict[str, float]] = {}
    for col in phase_cols:
        keys = sorted({k for s in samples[col] for k in s["phases"]})
        phases[col] = {k: statistics.median([s["phases"].get(k, 0.0) for s in samples[col]]) for k in keys}

    model = setup["model"]
    where = setup["dir"]
    print(
        f"\ncheckpoint benchmark: GPT d_model={model['d_model']} n_layers={model['n_layers']} "
        f"({model['params'] / 1e6:.1f}M params) -> {nbytes / 1e6:.1f} MB in {setup['checkpoint_files']} files "
        f"(model + AdamW moments)\nworld {setup['world_size']}, {setup['threads_per_rank']} torch threads/rank, "
        f"{setup['cpus']} cpus; folder {where['path']} ({where['fstype']} on {where['device']}, same filesystem as "
        f"repo: {where['same_filesystem_as_repo']})\n{setup['reps']} reps (+{setup['warmup_reps']} warm-up), "
        f"interleaved; medians (min..max); GB = 1e9 bytes; 1-min load average before/after "
        f"{setup['loadavg_1min_before_after'][0]:.1f}/{setup['loadavg_1min_before_after'][1]:.1f}\n"
    )
    rows = [
        ("raw write + fsync", "raw", gbps["raw"], ""),
        (
            "sync save (block=True)",
            "sync",
            gbps["sync"],
            f"save/raw = {results['save_over_raw']:.2f} (target >= 0.5); "
            f"blocks {results['sync_blocking_over_step']:.2f} steps",
        ),
        (
            "async save: blocked",
            "async_blocking",
            None,
            f"{results['async_blocking_over_sync_save']:.1%} of sync save (target <= 10%); "
            f"blocks {results['async_blocking_over_step']:.2f} steps",
        ),
        ("async save: total", "async", gbps["async"], "save() + wait() until committed"),
        ("restore (newest)", "restore", gbps["restore"], "SHA-256 verify + DCP load + set_state_dict"),
        (
            "train step",
            "step",
            None,
            f"forward + backward + AdamW, {setup['batch_per_rank']} x {setup['seq_len']} tokens/rank",
        ),
    ]
    print(f"{'measure':<24} {'seconds':>8} {'(min..max)':>16} {'GB/s':>7}  note\n" + "-" * 100)
    for label, key, bw, note in rows:
        spread = f"({t[key]['min']:.3f}..{t[key]['max']:.3f})"
        bw_text = f"{bw:7.3f}" if bw is not None else " " * 7
        print(f"{label:<24} {med[key]:8.3f} {spread:>16} {bw_text}  {note}")

    all_phases = sorted({k for col in phases.values() for k in col}, key=lambda k: (k.startswith("bg:"), k))
    print("\nwhere the time goes (rank 0, median seconds per save/restore; bg: = background thread)")
    print(f"{'phase':<24} " + " ".join(f"{c:>9}" for c in phase_cols) + "\n" + "-" * 56)
    for k in all_phases:
        print(
            f"{k:<24} "
            + " ".join(f"{phases[c].get(k, 0.0):9.3f}" if k in phases[c] else f"{'':>9}" for c in phase_cols)
        )
    other = {  # per sample: the measured time minus the wrapped phases (foreground only for async)
        c: statistics.median(
            s["blocking_s" if c == "async" else "seconds"]
            - sum(v for k, v in s["phases"].items() if not k.startswith("bg:"))
            for s in samples[c]
        )
        for c in phase_cols
    }
    print(f"{'other (unwrapped)':<24} " + " ".join(f"{other[c]:9.3f}" for c in phase_cols))
    print("(async column: foreground phases add up to the blocked time; bg: phases run after save() returned)")

    result = {
        "benchmark": "checkpoint",
        "setup": setup,
        "units": {"time": "s", "bw": "GB/s (1e9 bytes)"},
        "results": results,
        "targets": targets,
        "phases_median_s": phases,
        "phases_other_s": other,
    }
    text = json.dumps(result, indent=2)
    print("\n" + text, flush=True)
    if json_path:
        json_path.write_text(text + "\n")


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
