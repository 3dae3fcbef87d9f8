"""The pipeline bubble of each schedule, measured, beside its theoretical value.

    python bench/pipeline_bubble.py [--ranks 2] [--microbatches 4] [--d-model 256 --layers 8 --seq 128]
                                    [--schedules 1F1B,GPipe,...] [--steps 10 --skip 3 --rounds 1] [--json PATH]

One node of ``--ranks`` ranks, one pipeline stage group each (``parallel.pp`` = ranks, no data parallelism), 1 thread
per rank, the same GPT, data and batch under every schedule (``parallel.pp_schedule``; the interleaved and V ones
with 2 stages per rank), through ``python -m hpc.submit tiny --local``, alternated round by round. A step is one
loop micro-batch of ``--microbatches`` sequences, cut into that many pipeline micro-batches of one sequence.

The bubble is the share of rank 0's schedule and optimizer time (``time_compute_s`` + ``time_optim_s`` of
metrics.jsonl) not spent in its own stages' forward and backward chunks (``pp_compute_s``): waiting for the other
stages, the sends and receives, and at the step's end waiting for the last stage (the gradient norm's all-reduce,
in the optimizer part; the optimizer's own update, a few percent of a step here, counts as bubble too); median over
the steps after ``--skip``. The theory (p stage groups, m micro-batches, v stages per rank, forward and backward
chunks of equal cost across stages): GPipe and 1F1B (p - 1) / (m + p - 1); Interleaved1F1B (p - 1) / (v m + p - 1);
the zero-bubble schedules fill the bubble with weight-gradient chunks, 0 when a forward, an
input-gradient and a weight-gradient chunk cost the same (Qi et al. 2023, DeepSeek-V3's DualPipe), none stated here.
Give each rank a core of its own (``--ranks`` at most the machine's cores): a rank's idle time is the bubble only
when no other rank could use its core meanwhile.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import (  # bench/ is on sys.path
    ROOT,
    add_run_length,
    bench_parser,
    check_run_length,
    emit,
    lines,
    set_quiet_wait,
    wait_for_quiet,
)

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
ONE_STAGE = ("GPipe", "1F1B")  # one stage per rank; the others hold 2


def parse_args(argv: list[str] | None):
    p = bench_parser(__doc__, quiet_wait=True)
    p.add_argument("--ranks", type=int, default=2, help="ranks of the one node = pipeline stage groups (default 2)")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches a step (default 4)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=8, help="blocks (a multiple of 2 x ranks)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--schedules", default=",".join(SCHEDULES), help=f"subset of {','.join(SCHEDULES)}")
    add_run_length(p, steps=10, skip=3, rounds=1, of="schedule")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="for every run")
    args = p.parse_args(argv)
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = set(args.schedules) - set(SCHEDULES)
    if unknown:
        p.error(f"unknown schedules {sorted(unknown)}; choose from {', '.join(SCHEDULES)}")
    check_run_length(p, args)
    return args


def theory(schedule: str, p: int, m: int) -> float | None:
    """The bubble's share of a step, where a closed form holds (see the module's docstring)."""
    if schedule in ONE_STAGE:
        return (p - 1) / (m + p - 1)
    if schedule == "Interleaved1F1B":
        return (p - 1) / (2 * m + p - 1)
    return None


def run(args, schedule: str, out: Path) -> dict:
    m = args.microbatches
    sets = [
        "job.nodes=1", f"job.ranks_per_node={args.ranks}", "job.threads_per_rank=1",
        f"model.d_model={args.d_model}", f"model.n_heads={args.heads}", f"model.n_layers={args.layers}",
        f"model.seq_len={args.seq}", "model.dropout=0",
        f"train.steps={args.steps}", f"train.micro_batch_size={m}", f"train.global_batch_size={m}",
        "train.eval_every=0", "train.warmup_steps=1", "checkpoint.every_steps=0", "checkpoint.at_end=false",
        "monitor.tensorboard=false", "monitor.straggler_every=0", "monitor.preflight=off",
        f"parallel.pp={args.ranks}", "parallel.dp_replicate=1", "parallel.dp_shard=1",
        f"parallel.pp_schedule={schedule}", f"parallel.pp_stages_per_rank={1 if schedule in ONE_STAGE else 2}",
        f"parallel.pp_microbatches={m}", *args.sets,
    ]  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "hpc.submit", "tiny", "--local", "--run-dir", str(out)]
    cmd += [a for kv in sets for a in ("--set", kv)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{schedule} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = lines(out / "metrics.jsonl")
    kept = [r for r in rows if r["step"] > args.skip]
    return {
        "step_s": [r["step_time_s"] for r in kept],
        "bubble": [1 - r["pp_compute_s"] / (r["time_compute_s"] + r["time_optim_s"]) for r in kept],
        "final_loss": rows[-1]["loss"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_quiet_wait(args.quiet_wait_s)
    work = Path(tempfile.mkdtemp(prefix="bench-bubble-"))
    pooled: dict[str, dict] = {s: {"step_s": [], "bubble": []} for s in args.schedules}
    try:
        for r in range(args.rounds):
            for schedule in args.schedules:
                wait_for_quiet()
                got = run(args, schedule, work / f"{schedule}-{r}")
                pooled[schedule]["step_s"] += got["step_s"]
                pooled[schedule]["bubble"] += got["bubble"]
                pooled[schedule]["final_loss"] = got["final_loss"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    p, m = args.ranks, args.microbatches
    result = {
        "setup": {
            "ranks": p,
            "microbatches": m,
            "d_model": args.d_model,
            "layers": args.layers,
            "seq_len": args.seq,
            "steps": args.steps,
            "skip": args.skip,
            "rounds": args.rounds,
            "set": args.sets,
        },  # fmt: skip
        "schedules": {
            s: {
                "stages_per_rank": 1 if s in ONE_STAGE else 2,
                "median_step_s": statistics.median(x["step_s"]),
                "bubble": statistics.median(x["bubble"]),
                "bubble_theory": theory(s, p, m),
                "steps_measured": len(x["step_s"]),
                "final_loss": x["final_loss"],
            }
            for s, x in pooled.items()
        },
    }
    emit(result, args.json, show)
    return 0


def show(result: dict) -> None:
    s = result["setup"]
    print(f"pp {s['ranks']} (1 node), {s['microbatches']} micro-batches a step, GPT {s['layers']} x {s['d_model']}, "
          f"seq {s['seq_len']}")  # fmt: skip
    print(f"{'schedule':<22} {'stages/rank':>11} {'step s':>8} {'bubble':>7} {'theory':>7}")
    for name, x in result["schedules"].items():
        th = f"{x['bubble_theory']:.3f}" if x["bubble_theory"] is not None else "-"
        print(f"{name:<22} {x['stages_per_rank']:>11} {x['median_step_s']:>8.3f} {x['bubble']:>7.3f} {th:>7}")


if __name__ == "__main__":
    sys.exit(main())
