"""Data wait with and without prefetching: a recipe whose dataset is slow on purpose, through the real trainer.

The recipe (bench/recipes/slow_data.py, copied next to a config written into the work folder, so the submit-time
code snapshot finds it) trains an MLP on synthetic items whose ``__getitem__`` sleeps ``item_ms`` (a dataset that
reads each sample from slow storage; the sleep releases the GIL as file reads do). Every run is
``python -m hpc.submit CONFIG --local`` on 1 node x ``--ranks`` ranks, with ``data.prefetch`` = 0 (fetch in the
training thread) or N (N micro-batches fetched ahead by N threads).

First a calibration run (no sleep, prefetch 0) measures the step's compute C (median ``step_time_s -
time_data_s``). Each setting then fixes the fetch time of one micro-batch, F = ratio x C (``--ratios``, default
0.7: a dataset 70 % as slow as the step; 1.5: fetching one micro-batch alone takes longer than the whole step),
i.e. ``item_ms`` = F / micro-batch size. With ``accum`` micro-batches per step, fetching in the training thread
adds accum x F to every step; N prefetch threads fetch N micro-batches at once, which hides the data wait as long
as accum x F / N <= C, and otherwise leaves about accum x F / N - C (the ``expected`` column).

Runs alternate (every round runs every (setting, prefetch) once, in an order rotated per round); the first
``--skip`` steps of every run are left out. Prints a table and a JSON object (medians of ``time_data_s`` and
``step_time_s`` from metrics.jsonl over all rounds, ratios to prefetch 0 of the same setting).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import (  # bench/ is on sys.path
    OTHER_LOAD_LIMIT,
    ROOT,
    add_run_length,
    bench_parser,
    busy_cpu_s,
    check_run_length,
    children_cpu_s,
    emit,
    set_quiet_wait,
    wait_for_quiet,
)

RECIPE = ROOT / "bench" / "recipes" / "slow_data.py"
RECIPE_SPEC = "slow_data:recipe"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__, quiet_wait=True)
    p.add_argument("--ranks", type=int, default=2, help="ranks on the one node (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    add_run_length(p, steps=30, skip=5, rounds=3, of="(setting, prefetch)")
    p.add_argument("--micro-batch", type=int, default=16, help="items per rank per micro-batch (default 16)")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step (default 2)")
    p.add_argument("--hidden", type=int, default=1536, help="MLP width: sets the step's compute (default 1536)")
    p.add_argument("--layers", type=int, default=3, help="MLP hidden layers (default 3)")
    p.add_argument("--prefetch", default="0,2,4", help="data.prefetch values to compare (default 0,2,4)")
    p.add_argument("--ratios", default="0.7,1.5", help="one micro-batch's fetch time / the step's compute, per setting")
    p.add_argument("--compute-ms", type=float, help="the step's compute in ms (default: measured by a calibration run)")
    p.add_argument("--work-dir", type=Path, help="keep run directories and logs here (default: a temporary folder)")
    args = p.parse_args(argv)
    try:
        args.prefetch = [int(x) for x in args.prefetch.split(",")]
        args.ratios = [float(x) for x in args.ratios.split(",")]
    except ValueError:
        p.error("--prefetch takes integers, --ratios numbers, comma-separated")
    check_run_length(p, args)
    if 0 not in args.prefetch or min(args.prefetch) < 0:
        p.error("--prefetch needs 0 (the reference) and no negative values")
    if min(args.ratios) <= 0 or min(args.ranks, args.micro_batch, args.accum, args.rounds) < 1:
        p.error("--ratios must be > 0; --ranks, --micro-batch, --accum, --rounds >= 1")
    return args


def write_project(args: argparse.Namespace, folder: Path) -> Path:
    """The user-style project: the recipe module and its config side by side; returns the config file."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(RECIPE, folder / RECIPE.name)
    config = {
        "recipe": RECIPE_SPEC,
        "recipe_args": {"item_ms": 0.0, "hidden": args.hidden, "layers": args.layers},
        "job": {"name": "prefetch", "nodes": 1, "ranks_per_node": args.ranks, "threads_per_rank": args.threads},
        "train": {
            "steps": args.steps,
            "global_batch_size": args.micro_batch * args.ranks * args.accum,
            "micro_batch_size": args.micro_batch,
            "warmup_steps": 2,
            "eval_every": 0,
        },
        "checkpoint": {"every_steps": 0, "at_end": False},  # nothing but steps in the timed runs
        "comm": {"allreduce": "flat"},
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def one_run(config: Path, out: Path, item_ms: float, prefetch: int, skip: int, env: dict) -> dict:
    """One trainer launch; the post-warm-up records' data wait and step times."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hpc.submit", str(config), "--local", "--run-dir", str(out)]
    cmd += ["--set", f"recipe_args.item_ms={item_ms:.4f}", "--set", f"data.prefetch={prefetch}"]
    wait_for_quiet()
    t0, busy0, own0 = time.perf_counter(), busy_cpu_s(), children_cpu_s()
    with open(out.parent / f"{out.name}.log", "w") as log:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=log)
    wall = time.perf_counter() - t0
    other = (busy_cpu_s() - busy0 - (children_cpu_s() - own0)) / wall
    if proc.returncode != 0:
        raise RuntimeError(f"run {out.name} failed ({proc.returncode}); see {out.parent / f'{out.name}.log'}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "step_time_s" in r][skip:]
    return {
        "wall_s": wall,
        "other_load": other,
        "data_s": [float(r["time_data_s"]) for r in records],
        "step_s": [float(r["step_time_s"]) for r in records],
    }


def calibrate(args: argparse.Namespace, config: Path, work: Path, env: dict) -> float:
    """The step's compute in seconds: median step time minus data wait, without sleeps and without prefetch."""
    if args.compute_ms:
        return args.compute_ms / 1000.0
    run = one_run(config, work / "calibrate", 0.0, 0, args.skip, env)
    compute = statistics.median(s - d for s, d in zip(run["step_s"], run["data_s"], strict=True))
    print(
        f"calibration: step compute {1e3 * compute:.1f} ms (median step {1e3 * statistics.median(run['step_s']):.1f}"
        f" ms, data wait {1e3 * statistics.median(run['data_s']):.2f} ms; other processes used "
        f"{run['other_load']:.2f} cores)"
    )
    return compute


def expected_wait(prefetch: int, accum: int, fetch_s: float, compute_s: float) -> float:
    """Data wait per step predicted by throughput alone (prefetch N: N micro-batches fetched at once)."""
    if prefetch == 0:
        return accum * fetch_s
    return max(0.0, accum * fetch_s / prefetch - compute_s)


def run_cells(args: argparse.Namespace, config: Path, work: Path, env: dict, settings: list[dict]) -> dict:
    """Every (setting, prefetch) once a round, in an order rotated per round: {(setting index, prefetch): runs}."""
    cells = [(si, n) for si in range(len(settings)) for n in args.prefetch]
    runs: dict[tuple[int, int], list[dict]] = {c: [] for c in cells}
    for rnd in range(args.rounds):
        k = rnd % len(cells)
        for si, n in cells[k:] + cells[:k]:  # rotated, so no cell always runs first
            s = settings[si]
            run = one_run(config, work / f"r{rnd}" / f"x{s['ratio']:g}-p{n}", s["item_ms"], n, args.skip, env)
            run["round"] = rnd
            runs[(si, n)].append(run)
            data_ms, step_ms = 1e3 * statistics.median(run["data_s"]), 1e3 * statistics.median(run["step_s"])
            print(
                f"round {rnd + 1}/{args.rounds} fetch {s['ratio']:g} x compute, prefetch {n}: median data wait "
                f"{data_ms:6.1f} ms, step {step_ms:6.1f} ms (run {run['wall_s']:.1f} s, other processes used "
                f"{run['other_load']:.2f} cores)"
            )
    return runs


def result_rows(args: argparse.Namespace, settings: list[dict], runs: dict, compute: float) -> list[dict]:
    """Per (setting, prefetch): medians over all rounds, the expected wait, ratios to prefetch 0 of the setting."""
    results = []
    for si, s in enumerate(settings):
        base = None
        for n in args.prefetch:
            rs = runs[(si, n)]
            data = statistics.median(t for r in rs for t in r["data_s"])
            step = statistics.median(t for r in rs for t in r["step_s"])
            row = {
                "fetch_over_compute": s["ratio"],
                "item_ms": s["item_ms"],
                "micro_batch_fetch_s": s["fetch_s"],
                "prefetch": n,
                "median_time_data_s": data,
                "median_step_time_s": step,
                "expected_time_data_s": expected_wait(n, args.accum, s["fetch_s"], compute),
                "round_medians": [
                    {"data_s": statistics.median(r["data_s"]), "step_s": statistics.median(r["step_s"])} for r in rs
                ],
            }
            if n == 0:
                base = row
            assert base is not None  # prefetch 0 comes first
            row["step_speedup_vs_prefetch0"] = base["median_step_time_s"] / step
            row["data_wait_vs_prefetch0"] = data / base["median_time_data_s"] if base["median_time_data_s"] else None
            results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_quiet_wait(args.quiet_wait_s)
    sys.stdout.reconfigure(line_buffering=True)
    started = time.perf_counter()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-prefetch-"))
    work.mkdir(parents=True, exist_ok=True)
    config = write_project(args, work / "slow-project")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = str(args.threads)
    try:
        compute = calibrate(args, config, work, env)
        settings = [
            {"ratio": r, "fetch_s": r * compute, "item_ms": 1e3 * r * compute / args.micro_batch} for r in args.ratios
        ]
        runs = run_cells(args, config, work, env, settings)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    disturbed = [
        f"F/C {settings[si]['ratio']:g} prefetch {n} round {r['round'] + 1}"
        for (si, n), rs in runs.items()
        for r in rs
        if r["other_load"] > OTHER_LOAD_LIMIT
    ]
    result = {
        "benchmark": "prefetch",
        "setup": {
            "ranks": args.ranks,
            "threads_per_rank": args.threads,
            "steps": args.steps,
            "skip": args.skip,
            "rounds": args.rounds,
            "micro_batch": args.micro_batch,
            "accum": args.accum,
            "mlp": {"hidden": args.hidden, "layers": args.layers},
            "compute_s": compute,
            "compute_measured": not args.compute_ms,
        },
        "disturbed_runs": disturbed,
        "results": result_rows(args, settings, runs, compute),
        "wall_s": time.perf_counter() - started,
    }
    emit(result, args.json, show)
    return 0


def show(result: dict) -> None:
    """The table of every (setting, prefetch), then which runs were disturbed."""
    s = result["setup"]
    print(
        f"\nprefetch: 1 node x {s['ranks']} ranks, {s['threads_per_rank']} thread(s)/rank, MLP {s['mlp']['layers']} x "
        f"{s['mlp']['hidden']}, micro-batch {s['micro_batch']}, {s['accum']} micro-batches/step, {s['steps']} steps "
        f"(first {s['skip']} skipped), {s['rounds']} rounds\nstep compute C = {1e3 * s['compute_s']:.1f} ms; F = "
        "fetch time of one micro-batch; medians over all rounds; expected = accum x F (prefetch 0), "
        "max(0, accum x F / N - C) (prefetch N)\n"
    )
    head = (
        f"{'F / C':>5} | {'item ms':>7} | {'F ms':>6} | {'prefetch':>8} | {'data wait ms':>12} | {'expected':>8} | "
        f"{'step ms':>7} | {'speedup':>7} | {'wait / p0':>9}"
    )
    print(head + "\n" + "-" * len(head))
    for row in result["results"]:
        wait_ratio = row["data_wait_vs_prefetch0"]
        print(
            f"{row['fetch_over_compute']:>5g} | {row['item_ms']:>7.2f} | {1e3 * row['micro_batch_fetch_s']:>6.1f} | "
            f"{row['prefetch']:>8} | {1e3 * row['median_time_data_s']:>12.1f} | "
            f"{1e3 * row['expected_time_data_s']:>8.1f} | {1e3 * row['median_step_time_s']:>7.1f} | "
            f"{row['step_speedup_vs_prefetch0']:>6.2f}x | "
            + (f"{wait_ratio:>9.3f}" if wait_ratio is not None else f"{'-':>9}")
        )
    disturbed = result["disturbed_runs"]
    if disturbed:
        print(
            f"\nwarning: other processes used more than {OTHER_LOAD_LIMIT} cores during {len(disturbed)} of "
            f"{len(result['results']) * s['rounds']} runs: their figures are disturbed; rerun on a quiet machine."
        )


if __name__ == "__main__":
    sys.exit(main())
