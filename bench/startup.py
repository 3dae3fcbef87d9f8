"""A launch's start-up: where its seconds go, and the two things the trainer does to shorten it, each measured
side by side with what it replaced.

    python bench/startup.py [--rounds 6] [--launches 6] [--nodes 2 --ranks 2] [--json PATH]

Three parts, the two sides of each comparison alternated in one invocation: the start-up imports with the
collector on and off, MPI waits blocking against patient, and one-step launches of the tiny model phase by phase
(what each measures: bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (  # bench/ is on sys.path
    ROOT,
    add_nodes_ranks,
    bench_parser,
    children_cpu_s,
    emit,
    lines,
    mpirun_and_env,
    set_quiet_wait,
    wait_for_quiet,
)

IMPORTS = "import torch, torch.distributed.checkpoint, torch._dynamo, torch.nn.parallel"
PHASES = ("imports", "mpi", "rendezvous", "recipe", "build", "restore", "preflight")
SETS = ["model.d_model=64", "model.n_layers=2", "model.seq_len=64", "train.steps=1", "train.warmup_steps=1",
        "train.eval_every=0"]  # fmt: skip
WORK_MATMULS = 400  # rank 0's work in the waits part: ~0.4 s of 256 x 256 matmuls on one core here


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__, quiet_wait=True)
    p.add_argument("--rounds", type=int, default=6, help="rounds of each side of the imports and waits comparisons")
    p.add_argument("--launches", type=int, default=6, help="one-step launches (0: skip)")
    add_nodes_ranks(p, nodes=2, ranks=2)
    p.add_argument("--wait-worker", choices=("blocking", "patient"), help=argparse.SUPPRESS)
    p.add_argument("--wait-out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def import_seconds(collector: bool) -> float:
    """Seconds a fresh interpreter takes for IMPORTS, the collector on or off (timed inside, after start-up)."""
    pre = "" if collector else "import gc; gc.disable(); "
    code = f"import time; {pre}t = time.perf_counter(); {IMPORTS}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out)


def wait_worker(mode: str, out: Path) -> None:
    """One round on every rank (under mpirun): rank 0 works, the others wait; each rank writes OUT/rank_N.json."""
    import torch
    from mpi4py import MPI

    from trainer.env import patient_allgather

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    a = torch.full((256, 256), 0.5)
    comm.Barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    if comm.rank == 0:
        for _ in range(WORK_MATMULS):
            torch.mm(a, a)
    work = time.perf_counter() - t0
    if mode == "patient":
        patient_allgather(comm, comm.rank)
    else:
        comm.allgather(comm.rank)
    figures = {"rank": comm.rank, "work_s": work, "cpu_s": time.process_time() - cpu0}
    (out / f"rank_{comm.rank}.json").write_text(json.dumps(figures))


def wait_round(mode: str, args: argparse.Namespace) -> dict:
    found = mpirun_and_env(per_node=args.ranks, threads=1)
    if found is None:
        raise SystemExit(2)
    mpirun, env = found
    n = args.nodes * args.ranks
    with tempfile.TemporaryDirectory(prefix="bench-startup-waits-") as out:
        cmd = [str(mpirun), "-n", str(n), sys.executable, __file__, "--wait-worker", mode, "--wait-out", out]
        subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=ROOT)
        rows = [json.loads((Path(out) / f"rank_{r}.json").read_text()) for r in range(n)]
    return {"work_s": rows[0]["work_s"], "waiters_cpu_s": sum(r["cpu_s"] for r in rows[1:])}


def small_dataset(folder: Path) -> Path:
    """About 2 MB of the standard library's sources, prepared once (before any timing)."""
    from trainer.data.prepare import PrepareSpec, prepare

    out = folder / "data"
    spec = PrepareSpec(
        source="stdlib", include=("*.py",), max_source_bytes=2_000_000, val_fraction=0.1, shard_tokens=400_000
    )
    prepare(spec, out)
    return out


def launch(run_dir: Path, data: Path, args: argparse.Namespace) -> dict:
    sets = [*SETS, f"data.path={data}", f"job.nodes={args.nodes}", f"job.ranks_per_node={args.ranks}"]
    cmd = [sys.executable, "-m", "hpc.submit", "tiny", "--local", "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0, cpu0 = time.perf_counter(), children_cpu_s()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall, cpu = time.perf_counter() - t0, children_cpu_s() - cpu0
    if proc.returncode:
        raise RuntimeError(f"launch failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    events = lines(run_dir / "history.jsonl")
    start = next(e for e in events if e["event"] == "start")
    preflight = next((e for e in events if e["event"] == "preflight"), None)
    node_s = [n["seconds"] for n in preflight["nodes"]] if preflight else []
    gap = max(node_s) - min(node_s) if len(node_s) > 1 else 0.0
    return {"wall_s": wall, "cpu_s": cpu, **start["startup_s"], "preflight_node_gap_s": gap}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.wait_worker:
        wait_worker(args.wait_worker, args.wait_out)
        return 0
    set_quiet_wait(args.quiet_wait_s)
    tmp = tempfile.TemporaryDirectory(prefix="bench-startup-")
    data = small_dataset(Path(tmp.name)) if args.launches else None
    wait_for_quiet()
    imports: dict[str, list[float]] = {"on": [], "off": []}
    waits: dict[str, list[dict]] = {"blocking": [], "patient": []}
    for _ in range(args.rounds):
        for side in ("on", "off"):
            imports[side].append(import_seconds(collector=side == "on"))
        for mode in ("blocking", "patient"):
            waits[mode].append(wait_round(mode, args))
    runs: list[dict] = []
    with tmp:
        for i in range(args.launches):
            runs.append(launch(Path(tmp.name) / f"run{i}", data, args))

    med = statistics.median
    result = {
        "layout": f"{args.nodes}x{args.ranks}",
        "imports_s": {side: med(v) for side, v in imports.items()},
        "imports_ratio_off_vs_on": med(imports["off"]) / med(imports["on"]),
        "waits": {mode: {k: med(r[k] for r in rs) for k in ("work_s", "waiters_cpu_s")} for mode, rs in waits.items()},
        "launches": {
            key: {"median": med(r[key] for r in runs), "max": max(r[key] for r in runs)}
            for key in ("wall_s", "cpu_s", *PHASES, "preflight_node_gap_s")
        }
        if runs
        else {},
        "rounds": args.rounds,
        "n_launches": len(runs),
    }
    emit(result, args.json, show)
    return 0


def show(result: dict) -> None:
    on, off = result["imports_s"]["on"], result["imports_s"]["off"]
    print(f"imports ({result['rounds']} rounds each, alternating), median s: collector on {on:.2f}, off "
          f"{off:.2f} ({result['imports_ratio_off_vs_on']:.2f}x)")  # fmt: skip
    print(f"waits ({result['layout']} ranks, rank 0 works, {result['rounds']} rounds each), median:")
    print("| wait | rank 0's work s | waiters' CPU s |\n|---|---:|---:|")
    for mode, figures in result["waits"].items():
        print(f"| {mode} | {figures['work_s']:.3f} | {figures['waiters_cpu_s']:.2f} |")
    if result["n_launches"]:
        print(f"launches ({result['n_launches']} one-step launches, {result['layout']} ranks), seconds:")
        print("| | median | max |\n|---|---:|---:|")
        for key, figures in result["launches"].items():
            print(f"| {key} | {figures['median']:.2f} | {figures['max']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
