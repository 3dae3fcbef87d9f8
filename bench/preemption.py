"""Preemption latency on the real local Slurm cluster: from the scheduler's signal to the committed checkpoint,
to the job running again, and to its first new step.

    python bench/preemption.py [--reps 2] [--methods signal,requeue,preempt] [--slurm-conf FILE] [--json PATH]

Starts its own cluster (envs/slurm/cluster.sh, separate ports and state; ``--slurm-conf`` uses a running one of
cluster.sh's instead, e.g. the test session's), submits the tiny model on 2 nodes x 2 ranks through `python -m
hpc.submit`, and interrupts it three ways (``--methods``: a subset): the job's signal (`scancel --signal=USR2`),
`scontrol requeue`, and a job in the higher-priority partition. Times come from one clock on this host: the moment
the interruption was issued, the trainer's history events (`stopped` is written right after the commit, `resume`
right after the checkpoint is loaded), the first RUNNING poll of the requeued job (0.1 s resolution), and the
first new step's metrics record. Prints a table and a JSON object.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (  # bench/ is on sys.path
    ROOT,
    add_slurm_options,
    bench_parser,
    chosen_methods,
    emit,
    lines,
    sh,
    slurm_cluster,
    wait,
)

from rundir.contract import EVENT_RESUME, EVENT_STOPPED

PORTS = {"HPC_SLURM_CTLD_PORT": "18917", "HPC_SLURM_NODE_PORT": "19101"}
METHODS = ("signal", "requeue", "preempt")
SETS = ["train.steps=400", "train.warmup_steps=2", "train.eval_every=0", "model.d_model=64", "model.n_layers=2",
        "model.seq_len=64", "checkpoint.every_steps=50"]  # fmt: skip


def job_state(job: str) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def one(method: str, data: Path, work: Path) -> dict:
    run_dir = work / f"{method}-{time.monotonic_ns()}"
    args = [sys.executable, "-m", "hpc.submit", "tiny", "--run-dir", str(run_dir), "--set", f"data.path={data}"]
    for s in SETS:
        args += ["--set", s]
    sh(*args, cwd=ROOT)
    job = json.loads((run_dir / "jobs.jsonl").read_text().splitlines()[-1])["job_id"]
    wait(lambda: any(r.get("step", 0) >= 20 for r in lines(run_dir / "metrics.jsonl")))
    issued = time.time()  # trainer event times come from time.time() on this same host
    if method == "signal":
        sh("scancel", "--signal=USR2", job)
    elif method == "requeue":
        sh("scontrol", "requeue", job)
    else:
        sh(
            "sbatch",
            "-p",
            "urgent",
            "-N2",
            "--ntasks-per-node=4",
            f"--output={work}/urgent-%j.out",
            "--wrap",
            "sleep 1",
        )

    def running_again() -> bool:
        state = job_state(job)
        return state.get("Restarts", "0") != "0" and state.get("JobState") == "RUNNING"

    wait(running_again)
    running_at = time.time()
    resume = wait(lambda: [e for e in lines(run_dir / "history.jsonl") if e["event"] == EVENT_RESUME])[0]
    first = wait(lambda: [r for r in lines(run_dir / "metrics.jsonl") if r["step"] == resume["step"] + 1])[0]
    stopped = [e for e in lines(run_dir / "history.jsonl") if e["event"] == EVENT_STOPPED]
    subprocess.run(["scancel", job], check=False)
    return {
        "method": method,
        "committed_s": stopped[0]["time"] - issued if stopped else None,  # None: killed before a commit
        "running_again_s": running_at - issued,
        "resumed_s": resume["time"] - issued,
        "first_new_step_s": first["time"] - issued,
        "steps_recomputed": (stopped[0]["step"] if stopped else 0) - resume["step"],
        # RUNNING -> the new launch's first process started (submitit, the driver, srun), then its start-up phases
        "to_process_start_s": resume["process_start"] - running_at,
        "startup_s": resume.get("startup_s", {}),
    }


KEYS = ("committed_s", "running_again_s", "resumed_s", "first_new_step_s")


def main() -> int:
    p = bench_parser(__doc__)
    p.add_argument("--reps", type=int, default=2)
    add_slurm_options(p, METHODS)
    args = p.parse_args()
    methods = chosen_methods(p, args.methods, METHODS)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    work = Path(tempfile.mkdtemp(prefix="bench-preempt-"))
    with slurm_cluster(PORTS, args.slurm_conf):
        from trainer.data.prepare import PrepareSpec, prepare

        data = work / "data"
        prepare(PrepareSpec(source="stdlib", include=("*.py",), max_source_bytes=2_000_000, val_fraction=0.1,
                            shard_tokens=400_000), data)  # fmt: skip
        rows = [one(m, data, work) for _ in range(args.reps) for m in methods]
    summary = {}
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        summary[method] = {k: statistics.median(r[k] for r in mine if r[k] is not None)
                           if any(r[k] is not None for r in mine) else None for k in KEYS}  # fmt: skip
    result = {"benchmark": "preemption", "setup": {"reps": args.reps, "methods": methods, "config": SETS},
              "summary": summary, "runs": rows}  # fmt: skip
    emit(result, args.json, show)
    return 0


def show(result: dict) -> None:
    """The medians per interruption, then each repetition's way back: to the ranks' start, their start-up phases."""
    print(f"\n{'interruption':14} " + " ".join(f"{k:>17}" for k in KEYS) + "   (medians, seconds after issuing it)")
    for method, med in result["summary"].items():
        print(f"{method:14} " + " ".join(f"{'-' if v is None else f'{v:.2f}':>17}" for v in med.values()))
    rows = result["runs"]
    phases = sorted({k for r in rows for k in r["startup_s"]}, key=list(rows[0]["startup_s"]).index)
    print("\nafter RUNNING again, per rep (s): until the ranks' processes start, then the trainer's start-up phases")
    print(f"{'interruption':14} {'to start':>8} " + " ".join(f"{k:>10}" for k in phases))
    for r in rows:
        cells = " ".join(f"{r['startup_s'].get(k, float('nan')):>10.2f}" for k in phases)
        print(f"{r['method']:14} {r['to_process_start_s']:>8.2f} {cells}")


if __name__ == "__main__":
    sys.exit(main())
