"""Tokens/s and memory per rank of each parallel layout, side by side, and the largest model each fits under a
per-rank memory cap.

``python bench/parallel.py [--layouts ddp,fsdp,...] [--nodes N --ranks R]``: the same GPT, data and global batch
under every layout through ``python -m hpc.submit tiny --local``, alternated round by round (the layouts, figures
and the memory fit: bench/README.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import (  # bench/common.py (on sys.path)
    ROOT,
    add_nodes_ranks,
    add_run_length,
    bench_parser,
    check_run_length,
    emit,
    set_quiet_wait,
    wait_for_quiet,
)

LAYOUTS = {
    "ddp": ["parallel.dp_replicate=-1", "parallel.dp_shard=1"],
    "fsdp": ["parallel.dp_replicate=1", "parallel.dp_shard=-1"],
    "hsdp": ["parallel.dp_replicate=-1", "parallel.dp_shard={ranks}"],
    "fsdp-ac": ["parallel.dp_replicate=1", "parallel.dp_shard=-1", "parallel.activation_checkpointing=full"],
    "tp": ["parallel.dp_replicate=-1", "parallel.dp_shard=1", "parallel.tp={ranks}"],
    "tp-fsdp": ["parallel.dp_replicate=1", "parallel.dp_shard=-1", "parallel.tp={ranks}"],
    "pp": ["parallel.dp_replicate=-1", "parallel.dp_shard=1", "parallel.pp={nodes}"],
    "cp": ["parallel.dp_replicate=-1", "parallel.dp_shard=1", "parallel.cp={ranks}"],
    # several stages a rank: pipeline parallelism alone (one rank a node), 2 stages a rank, 2 x pp micro-batches
    **{
        f"pp-{name}": ["parallel.pp={nodes}", f"parallel.pp_schedule={kind}", "parallel.pp_stages_per_rank=2",
                       "parallel.pp_microbatches={microbatches}"]
        for name, kind in (("interleaved", "Interleaved1F1B"), ("izb", "InterleavedZeroBubble"),
                           ("zbv", "ZBVZeroBubble"), ("dualpipev", "DualPipeV"))
    },
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__, quiet_wait=True)
    add_nodes_ranks(p, nodes=2, ranks=2)
    p.add_argument("--d-model", type=int, default=512, help="model width (default 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--layers", type=int, default=8, help="blocks of the measured model (default 8: ~26M parameters)")
    p.add_argument("--small-layers", type=int, default=2, help="blocks of the second model of the memory fit")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--micro", type=int, default=2, help="sequences per rank per micro-batch (default 2)")
    add_run_length(p, steps=8, skip=3, rounds=1, of="layout")
    p.add_argument("--cap-mb", type=float, default=2048, help="per-rank memory cap for the fit (default 2048)")
    one_stage = [k for k in LAYOUTS if not k.startswith("pp-")]  # the pp-* ones: one rank a node (--ranks 1)
    p.add_argument("--layouts", default=",".join(one_stage), help=f"subset of {','.join(LAYOUTS)}")
    p.add_argument(
        "--also",
        metavar="KEY=VALUE",
        help="also run every layout with this config setting, side by side (e.g. train.host_mmap_threshold_kb=0)",
    )
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="a config setting for every run"
    )
    p.add_argument("--work-dir", type=Path, help="keep run directories here (default: a temporary folder)")
    args = p.parse_args(argv)
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = set(args.layouts) - set(LAYOUTS)
    if unknown:
        p.error(f"unknown layouts {sorted(unknown)}; choose from {', '.join(LAYOUTS)}")
    if args.also is not None and "=" not in args.also:
        p.error("--also takes KEY=VALUE")
    # Each entry: (label, layout, extra settings); with --also every layout twice, alternated within a round.
    args.variants = [(name, name, []) for name in args.layouts]
    if args.also:
        args.variants = [v for name in args.layouts for v in ((name, name, []), (f"{name}+", name, [args.also]))]
    check_run_length(p, args)
    return args


def sets(args: argparse.Namespace, layout: str, layers: int) -> list[str]:
    world = args.nodes * args.ranks
    return [
        f"job.nodes={args.nodes}", f"job.ranks_per_node={args.ranks}", "job.threads_per_rank=1",
        f"model.d_model={args.d_model}", f"model.n_heads={args.heads}", f"model.n_layers={layers}",
        f"model.seq_len={args.seq}", "model.dropout=0",
        f"train.steps={args.steps}", f"train.micro_batch_size={args.micro}",
        f"train.global_batch_size={args.micro * world}", "train.eval_every=0", "train.warmup_steps=1",
        "comm.allreduce=flat", "checkpoint.every_steps=0", "checkpoint.at_end=false",
        "monitor.tensorboard=false", "monitor.straggler_every=0", "monitor.preflight=off",
        *(s.format(ranks=args.ranks, nodes=args.nodes, microbatches=2 * args.nodes) for s in LAYOUTS[layout]),
        *args.sets,
    ]  # fmt: skip


def run(args: argparse.Namespace, layout: str, layers: int, out: Path, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "hpc.submit", "tiny", "--local", "--run-dir", str(out)]
    cmd += [a for kv in [*sets(args, layout, layers), *extra] for a in ("--set", kv)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{layout} ({layers} layers) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((out / "summary.json").read_text())
    events = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines() if x.strip()]
    start = next(e for e in events if e["event"] == "start")
    return {
        "built_mem_mb": start["peak_mem_mb"]["model_built"],
        "step_s": [r["step_time_s"] for r in records if r["step"] > args.skip],
        "comm": [{"all": r["time_comm_s"], **(r.get("comm_by_dim") or {})} for r in records if r["step"] > args.skip],
        "peak_mem_mb": max(r.get("peak_mem_mb") or 0 for r in records),
        "state_mb": {k: v / 2**20 for k, v in summary["state_bytes_per_rank"].items()},
        "n_params": summary["n_params"],
        "allreduce": summary["allreduce"],
    }


def run_all(args: argparse.Namespace, work: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    """Every variant at ``--layers`` each round (their steps and communication pooled over the rounds), then once at
    ``--small-layers`` for the memory fit: (big, small) by label."""
    big: dict[str, dict] = {label: {"step_s": []} for label, _, _ in args.variants}
    small: dict[str, dict] = {}
    for r in range(args.rounds):
        for label, name, extra in args.variants:
            wait_for_quiet()
            got = run(args, name, args.layers, work / f"{label}-{r}", extra)
            big[label] = {
                **got,
                "step_s": big[label]["step_s"] + got["step_s"],
                "comm": big[label].get("comm", []) + got["comm"],
            }
    for label, name, extra in args.variants:
        wait_for_quiet()
        small[label] = run(args, name, args.small_layers, work / f"{label}-small", extra)
    return big, small


def layout_figures(b: dict, s: dict, base: float | None, tokens_per_step: int, cap_mb: float) -> dict:
    """One layout's entry of the JSON from its big (``b``) and small (``s``) runs; ``base``: ddp's median step."""
    step = statistics.median(b["step_s"])
    per_param = (b["peak_mem_mb"] - s["peak_mem_mb"]) / (b["n_params"] - s["n_params"])
    fixed = b["peak_mem_mb"] - per_param * b["n_params"]
    fits = (cap_mb - fixed) / per_param if per_param > 0 else float("inf")
    dims = sorted({d for c in b["comm"] for d in c})
    exposed = {d: 1000 * statistics.median(c.get(d, 0.0) for c in b["comm"]) for d in dims}
    return {
        "allreduce": b["allreduce"],
        "median_step_s": step,
        "tokens_per_s": tokens_per_step / step,
        # rank 0's exposed communication per step, in all and per parallel dimension (medians, ms)
        "exposed_comm_ms": exposed,
        "vs_ddp": base / step if base else None,
        "peak_mem_mb": b["peak_mem_mb"],
        "built_mem_mb": b["built_mem_mb"],
        "state_mb_per_rank": b["state_mb"],
        "n_params": b["n_params"],
        "small": {"n_params": s["n_params"], "peak_mem_mb": s["peak_mem_mb"]},
        "mb_per_million_params": per_param * 1e6,
        "fixed_mb": fixed,
        "largest_params_under_cap": fits,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_quiet_wait(args.quiet_wait_s)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-parallel-"))
    tokens_per_step = args.micro * args.nodes * args.ranks * args.seq
    big, small = run_all(args, work)
    result: dict = {
        "setup": {
            "nodes": args.nodes, "ranks_per_node": args.ranks, "d_model": args.d_model, "layers": args.layers,
            "small_layers": args.small_layers, "seq_len": args.seq, "micro_batch": args.micro,
            "tokens_per_step": tokens_per_step, "steps": args.steps, "skip": args.skip, "rounds": args.rounds,
            "cap_mb": args.cap_mb, "also": args.also, "set": args.sets,
        },
        "layouts": {},
    }  # fmt: skip
    base = statistics.median(big["ddp"]["step_s"]) if "ddp" in big else None
    for name, _, _ in args.variants:
        result["layouts"][name] = layout_figures(big[name], small[name], base, tokens_per_step, args.cap_mb)
    emit(result, args.json, functools.partial(show, steps=len(big[args.layouts[0]]["step_s"])))
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def show(result: dict, steps: int) -> None:
    """The layouts' table (``steps``: the step times behind each median), then their exposed communication."""
    setup, layouts = result["setup"], result["layouts"]
    first = next(iter(layouts.values()))
    print(f"{setup['nodes']} nodes x {setup['ranks_per_node']} ranks, {first['n_params'] / 1e6:.1f}M parameters, "
          f"{setup['tokens_per_step']} tokens/step, median of {steps} steps")  # fmt: skip
    if setup["also"]:
        print(f"'+': with {setup['also']}")
    print(f"{'layout':8} {'tokens/s':>9} {'vs ddp':>7} {'built MB':>9} {'peak MB':>8} {'state MB/rank':>14} "
          f"{'MB per 1M params':>17} {'largest under ' + format(setup['cap_mb'], 'g') + ' MB':>22}")  # fmt: skip
    for name, x in layouts.items():
        state = sum(x["state_mb_per_rank"].values())
        vs = f"{x['vs_ddp']:.2f}" if x["vs_ddp"] else "-"
        print(f"{name:8} {x['tokens_per_s']:9.0f} {vs:>7} {x['built_mem_mb']:9.0f} {x['peak_mem_mb']:8.0f} "
              f"{state:14.1f} {x['mb_per_million_params']:17.2f} "
              f"{x['largest_params_under_cap'] / 1e6:20.0f} M")  # fmt: skip
    print()
    print("exposed communication of rank 0, ms per step (median): in all, then per parallel dimension")
    for name, x in layouts.items():
        parts = ", ".join(f"{d} {ms:.1f}" for d, ms in x["exposed_comm_ms"].items() if d != "all")
        print(f"{name:8} {x['exposed_comm_ms'].get('all', 0.0):7.1f}   {parts}")


if __name__ == "__main__":
    sys.exit(main())
