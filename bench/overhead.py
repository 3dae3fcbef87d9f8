"""Tokens/s of this trainer vs plain torch DDP (bench/plain_ddp.py under torchrun): same model, data and batch; with
``--layout fsdp|hsdp|tp-fsdp|cp|pp``, vs the plain script of that layout (bench/plain_layouts.py).

``python bench/overhead.py [--nodes N --ranks R] [--variants a,b] [--nanogpt DIR]``: every variant alternated
round by round on simulated nodes (the variants, the figures and how to read them: bench/README.md). The variants
and their command lines are in bench/overhead_variants.py, the runs in overhead_runs.py, the result in
overhead_report.py.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import mpi4py
import nanogpt  # bench/nanogpt.py
import parallel  # bench/parallel.py: the layouts' settings
from common import (  # bench/common.py (bench/ on sys.path)
    add_nodes_ranks,
    add_run_length,
    bench_parser,
    check_run_length,
    emit,
    emulated_link,
    set_quiet_wait,
)

mpi4py.rc.initialize = False  # trainer.data imports mpi4py; this process only orchestrates, MPI runs in the children
from overhead_report import result_of, show  # noqa: E402
from overhead_runs import run_rounds  # noqa: E402
from overhead_variants import (  # noqa: E402
    ALL_VARIANTS,
    NANO,
    PLAIN_LAYOUTS,
    chosen_variants,
    write_flat_plan,
    write_user_recipe,
)

from runconfig import load_config  # noqa: E402
from rundir.contract import data_cache  # noqa: E402
from rundir.paths import RunDir  # noqa: E402
from tracking import create_store, resolve  # noqa: E402
from trainer.data.prepare import prepare  # noqa: E402
from trainer.data.resolve import dataset_folder, prepare_spec  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__, quiet_wait=True)
    p.add_argument("--config", default="tiny", help="config file or example name (default tiny)")
    add_nodes_ranks(p, nodes=1, ranks=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument(
        "--layout",
        default="ddp",
        choices=("ddp", *PLAIN_LAYOUTS),
        help="the parallel layout of both sides (default ddp; the others against bench/plain_layouts.py)",
    )
    add_run_length(p, steps=60, skip=10, rounds=3, of="variant")
    p.add_argument(
        "--variants",
        help=f"comma-separated subset of {','.join(ALL_VARIANTS[1:])} to run (plain, the reference, always runs)",
    )
    p.add_argument("--data", type=Path, help="prepared dataset folder (default: the config's, prepared if missing)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--work-dir", type=Path, help="keep run directories and logs here (default: a temporary folder)")
    p.add_argument("--link-mbit", type=float, help="emulate 2 real nodes joined by a link of this rate (root)")
    p.add_argument(
        "--nanogpt",
        type=Path,
        metavar="DIR",
        help="also run karpathy's nanoGPT from this checkout (its train.py, model.py, configurator.py) side by side",
    )
    args = p.parse_args(argv)
    args.namespaces = ()
    check_run_length(p, args)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The parser's error for a layout, link or nanoGPT the topology cannot have; ``--variants`` as a set."""
    if args.layout.startswith("pp-"):  # several stages a rank: pipeline parallelism alone
        if args.nodes < 2 or args.ranks != 1:
            p.error(f"--layout {args.layout} needs 2 or more nodes (--nodes) of one rank (--ranks 1)")
    elif args.layout not in ("ddp", "fsdp", "cp") and (args.nodes < 2 or args.ranks < 2):
        p.error(f"--layout {args.layout} needs 2 or more nodes (--nodes) of 2 or more ranks (--ranks)")
    elif args.layout == "cp" and args.ranks < 2:
        p.error("--layout cp splits each sequence over a node's ranks: it needs 2 or more (--ranks)")
    if args.layout != "ddp" and args.nanogpt:
        p.error("--nanogpt is a DDP peer: run it with --layout ddp")
    if args.link_mbit and (args.nodes != 2 or os.geteuid() != 0):
        p.error("--link-mbit emulates 2 nodes (--nodes 2) with network namespaces, which needs root")
    if args.variants:
        chosen = {v.strip() for v in args.variants.split(",") if v.strip()}
        if chosen - set(ALL_VARIANTS):
            p.error(f"unknown variants {sorted(chosen - set(ALL_VARIANTS))}; choose from {', '.join(ALL_VARIANTS)}")
        args.variants = chosen | {"plain"}
    if args.nanogpt and args.variants:
        args.variants |= {"nanogpt"}
    if (args.variants and set(NANO) & args.variants) and not args.nanogpt:
        p.error("the nanogpt variants need --nanogpt DIR (a checkout of https://github.com/karpathy/nanoGPT)")


def data_folder(args: argparse.Namespace, overrides: list[str]) -> Path:
    """The prepared dataset both sides read; prepared here (before any timing) if it is missing."""
    if args.data:
        return args.data.resolve()
    cfg = load_config(args.config, overrides)
    cache = data_cache(os.environ)
    folder = dataset_folder(cfg.data, cache)
    if not (folder / "manifest.json").is_file():
        print(f"preparing {cfg.data.source} into {folder} (first use)")
        prepare(prepare_spec(cfg.data), folder)
    return folder


def base_overrides(args: argparse.Namespace) -> list[str]:
    """Every run's settings: the topology, the steps, eval off, the layout's parallel.* and ``--set``'s."""
    return [
        f"job.nodes={args.nodes}",
        f"job.ranks_per_node={args.ranks}",
        f"job.threads_per_rank={args.threads}",
        f"train.steps={args.steps}",
        "train.eval_every=0",
        *(
            kv.format(ranks=args.ranks, nodes=args.nodes, microbatches=2 * args.nodes)
            for kv in parallel.LAYOUTS[args.layout]
        ),  # fmt: skip
        *args.overrides,
    ]


def prepare_work(args: argparse.Namespace, variants: tuple[str, ...], overrides: list[str], work: Path, cfg) -> None:
    """What the runs share, made before the first: one tracking store (``tracking.uri`` added to ``overrides``),
    trainer-recipe's project, trainer-auto-flat's plan, nanoGPT's work folders (NanoGPTError if it cannot)."""
    # One tracking store for every run of the invocation, made before the first, as a user's runs share the one
    # beside their run directories: each run pays opening it, none its creation (alembic's migrations, once).
    overrides.append(f"tracking.uri={work / 'mlflow.db'}")
    target = resolve(load_config(args.config, overrides).tracking, RunDir(work / "run"), {})
    if target is not None:
        create_store(target)
    if "trainer-recipe" in variants:
        args.recipe_config = write_user_recipe(args, overrides, work / "user-project")
    if "trainer-auto-flat" in variants:
        args.flat_plan = write_flat_plan(args, cfg, work / "flat_plan.json")
    args.nanogpt_folders = {}
    for variant in set(NANO) & set(variants):
        world, fused = args.nodes * args.ranks, variant == "nanogpt-fused"
        args.nanogpt_folders[variant] = nanogpt.prepare(
            args.nanogpt, work / variant, args.data, cfg, world, fused_cpu=fused
        )


def run_all(args: argparse.Namespace, variants: tuple[str, ...], overrides: list[str], work: Path) -> dict:
    """Every round, over the emulated link with ``--link-mbit`` (its namespaces removed on TERM too)."""
    if not args.link_mbit:
        return run_rounds(args, variants, overrides, work)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with emulated_link(args.link_mbit) as args.namespaces:
        return run_rounds(args, variants, overrides, work)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_quiet_wait(args.quiet_wait_s)
    variants = chosen_variants(args)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show up live through a pipe too
    started = time.perf_counter()
    overrides = base_overrides(args)
    args.data = data_folder(args, overrides)
    overrides.append(f"data.path={args.data}")
    cfg = load_config(args.config, overrides)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        prepare_work(args, variants, overrides, work, cfg)
    except nanogpt.NanoGPTError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        runs = run_all(args, variants, overrides, work)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    result = result_of(args, overrides, runs, tokens_per_step, started)
    emit(result, args.json, functools.partial(show, grad_accum=cfg.grad_accum(args.nodes * args.ranks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
