"""The memory plan (``python -m trainer.plan``) against the peaks of real CPU runs, layout by layout.

    python bench/memory_plan.py [--layouts ddp,fsdp,...] [--d-model 1024 --layers 4 --heads 8 --seq-len 32]
                                [--data PATH] [--json PATH]

Each layout runs the built-in GPT for 2 steps on 2 simulated nodes x 2 ranks (``python -m hpc.submit tiny --local``,
``parallel.meta_init`` and ``train.host_mmap_threshold_kb=64``: no whole model on the host before the split, freed
buffers handed back), and is planned with the same settings. Measured, per rank: its peak resident set less its
resident set with the recipe built (``summary.json`` ``memory_mb_per_rank``). Besides the step's tensors, which
the plan estimates, that holds what the runtime itself grows by at the first steps (kernels' code and scratch, the
loader's batches, gloo's staging; rank 0 also keeps the metrics): ~30 MB a rank, ~50 on rank 0. That part is
measured with a null model (``d_model`` 16, the same layout: its tensors take well under 1 MB) as its measured peak
less its planned one, and left out of the comparison: ``plan vs rest`` is planned / (measured - runtime) - 1. On a
GPU the device's peak holds tensors only, and the plan compares with it directly.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, bench_parser, emit  # bench/ is on sys.path

from runconfig import load_config

MIB = 2**20
NULL_WIDTH = 16  # the null model's d_model: its tensors take well under 1 MB
# name -> the layout's keys on 2 nodes x 2 ranks
LAYOUTS = {
    "ddp": ["comm.allreduce=flat"],
    "fsdp": ["parallel.dp_shard=4"],
    "fsdp_ac": ["parallel.dp_shard=4", "parallel.activation_checkpointing=full"],
    "hsdp": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
    "tp": ["parallel.tp=2"],
    "fsdp_tp": ["parallel.tp=2", "parallel.dp_shard=2"],
    "pp": ["parallel.pp=2", "train.micro_batch_size=2", "train.global_batch_size=4"],
    "cp": ["parallel.cp=2"],  # each sequence over a node's 2 ranks, 2 replicas: FSDP2 over cp
    "fsdp_cp": ["parallel.cp=2", "parallel.dp_shard=2", "train.micro_batch_size=2", "train.global_batch_size=4"],
    "tp_pp": ["parallel.pp=2", "parallel.tp=2", "train.micro_batch_size=2", "train.global_batch_size=4"],
    # 2 stages a rank beside FSDP2 (each stage module its own root) and beside TP, 2 stage groups of 2 ranks
    "interleaved_fsdp": [
        "parallel.pp=2",
        "parallel.pp_schedule=Interleaved1F1B",
        "parallel.pp_stages_per_rank=2",
        "parallel.dp_replicate=1",
        "parallel.dp_shard=2",
        "model.n_layers=4",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
    ],
    "interleaved_tp": [
        "parallel.pp=2",
        "parallel.pp_schedule=Interleaved1F1B",
        "parallel.pp_stages_per_rank=2",
        "parallel.tp=2",
        "model.n_layers=4",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
    ],
    # 4 stage groups of 2 stages, pipeline parallelism alone
    **{
        name: [
            "parallel.pp=4",
            f"parallel.pp_schedule={kind}",
            "parallel.pp_stages_per_rank=2",
            "model.n_layers=8",
            "train.micro_batch_size=4",
            "train.global_batch_size=4",
        ]
        for name, kind in (("interleaved", "Interleaved1F1B"),)
    },  # fmt: skip
}


def parse_args(argv: list[str] | None):
    p = bench_parser(__doc__)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of: " + ", ".join(LAYOUTS))
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--data", help="data.path (a prepared dataset; default: the tiny example's)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.layouts.split(",")) - set(LAYOUTS))
    if unknown:
        p.error(f"--layouts: unknown {', '.join(unknown)}")
    return args


def base_sets(args, d_model: int, heads: int) -> list[str]:
    return [
        f"model.d_model={d_model}", f"model.n_layers={args.layers}", f"model.n_heads={heads}",
        f"model.seq_len={args.seq_len}", "train.micro_batch_size=1", "train.global_batch_size=4", "train.steps=2",
        "train.warmup_steps=1", "train.eval_every=0", "parallel.meta_init=true", "train.host_mmap_threshold_kb=64",
        *([f"data.path={args.data}"] if args.data else []),
    ]  # fmt: skip


def python(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        tail = proc.stdout[-2000:] + proc.stderr[-4000:]
        raise SystemExit(f"{' '.join(args[:3])} failed ({proc.returncode}):\n{tail}")
    return proc


def one(name: str, sets: list[str], null_sets: list[str], tmp: Path) -> dict:
    """The layout's planned and measured peaks per rank; measured less the runtime's own growth (the null model's
    measured peak less its planned one)."""
    measured, plan = measure(name, sets, tmp), planned(sets)
    null_measured, null_plan = measure(name + "-null", null_sets, tmp), planned(null_sets)
    ranks = []
    for rank, (got, null) in enumerate(zip(measured, null_measured, strict=True)):
        want, runtime = plan[rank], null - null_plan[rank]
        ranks.append({"rank": rank, "planned_mb": want / MIB, "measured_mb": got / MIB, "runtime_mb": runtime / MIB,
                      "error": want / (got - runtime) - 1})  # fmt: skip
    return {"layout": load_config("tiny", sets).layout().describe(), "ranks": ranks,
            "worst_error": max((r["error"] for r in ranks), key=abs)}  # fmt: skip


def measure(name: str, sets: list[str], tmp: Path) -> list[float]:
    """Each rank's peak resident set less its resident set with the recipe built, bytes."""
    run_dir = tmp / name
    python(["-m", "hpc.submit", "tiny", "--local", *flags(sets), "--run-dir", str(run_dir)])
    summary = json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    return [(r["peak"] - r["runtime"]) * MIB for r in summary["memory_mb_per_rank"]]


def planned(sets: list[str]) -> list[int]:
    """Each rank's planned peak, bytes: the plan of its pipeline coordinate's rank."""
    plan = json.loads(python(["-m", "trainer.plan", "tiny", *flags(sets), "--json"]).stdout)
    by_pp = {r["pp"]: r["peak"] for r in plan["ranks"]}
    layout = load_config("tiny", sets).layout()
    return [by_pp[layout.coords(rank)["pp"]] for rank in range(plan["world_size"])]


def flags(sets: list[str]) -> list[str]:
    return [a for kv in sets for a in ("--set", kv)]


def show(result: dict) -> None:
    print(
        f"{'layout':10} {'rank':>4} {'planned MiB':>12} {'measured MiB':>13} {'runtime MiB':>12} {'plan vs rest':>13}"
    )
    for name, res in result["layouts"].items():
        for r in res["ranks"]:
            print(f"{name:10} {r['rank']:>4} {r['planned_mb']:>12.1f} {r['measured_mb']:>13.1f} "
                  f"{r['runtime_mb']:>12.1f} {r['error']:>+13.1%}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = {"model": {"d_model": args.d_model, "layers": args.layers, "seq_len": args.seq_len}, "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="bench-memory-plan-") as tmp:
        for name in args.layouts.split(","):
            sets = [*base_sets(args, args.d_model, args.heads), *LAYOUTS[name]]
            null = [*base_sets(args, NULL_WIDTH, 2), *LAYOUTS[name]]
            result["layouts"][name] = one(name, sets, null, Path(tmp))
            print(f"{name}: worst {result['layouts'][name]['worst_error']:+.1%}", file=sys.stderr, flush=True)
    emit(result, args.json, show)


if __name__ == "__main__":
    main()
