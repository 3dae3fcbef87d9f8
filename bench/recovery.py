"""Recovery from a crashed rank or a lost node: time from the loss to the first new step, restarting in the job vs
going back through the queue, and the goodput of a run whose ranks are killed every K steps.

    python bench/recovery.py [--reps 2] [--methods local-kill,kill,requeue,node-kept,node-fail]
        [--goodput-steps 3000 --kill-every 1000] [--memory-every N] [--slurm-conf FILE] [--json PATH]

``--memory-every N`` adds checkpoints in node memory every N steps (checkpoint.memory_every_steps) to every run;
``--spares N`` warm spares (job.spare_ranks) to the local runs, the Slurm kills and the lost nodes, whose dead ranks
are then restarted in-process (restart_decided_s: the rejoin event, once the survivors joined the new generation).

On its own local Slurm clusters (envs/slurm/cluster.sh) and under the local launcher; the methods, the clock and
the goodput's definition: bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
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

from rundir import RunDir
from rundir.contract import EVENT_HANG, EVENT_REJOIN, EVENT_RESTART, EVENT_RESUME
from rundir.identity import read_identity
from storage.nodememory import remove_run

PORTS = {"HPC_SLURM_CTLD_PORT": "18927", "HPC_SLURM_NODE_PORT": "19121"}
METHODS = ("local-kill", "kill", "requeue", "node-kept", "node-fail")  # kill and requeue on Slurm; node-*: hosts
NODE_METHODS = ("node-kept", "node-fail")
HOSTS = {"HPC_SLURM_CTLD_PORT": "18947", "HPC_SLURM_NODE_PORT": "19141", "HPC_SLURM_NODES": "3",
         "HPC_SLURM_NETNS": "1", "HPC_SLURM_LINK_RATE": "1gbit", "HPC_SLURM_SLURMD_TIMEOUT": "10"}  # fmt: skip
# The kill restarts on the same nodes (job.exclude_bad_nodes=false): the 2-node bench cluster has no spare node.
SETS = ["train.steps=400", "train.warmup_steps=2", "train.eval_every=0", "model.d_model=64", "model.n_layers=2",
        "model.seq_len=64", "checkpoint.every_steps=10", "job.restart_backoff_s=0",
        "job.exclude_bad_nodes=false"]  # fmt: skip
# The kill at step 20 lands in the step-20 checkpoint (every 10 steps): the survivors wait in its agreement until a
# rank's diagnosis (failure.json) lets their SIGTERM watch end them (tests/slurm/test_slurm.py kills in a step).
# A node lost: 1 rank a node, a global batch that 3 and 2 nodes divide, the lost node left out.
NODE_SETS = [*SETS[:-1], "job.ranks_per_node=1", "train.global_batch_size=24", "train.micro_batch_size=4"]
NODE_SHAPES = {
    "node-kept": ["job.nodes=3", "job.min_nodes=2", "job.no_kill=true"],
    "node-fail": ["job.nodes=2"],
}


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the launcher's process of ``rank``: PMI_RANK under MPI (hpc/spawn.py sets it too), SLURM_PROCID for
    srun's tasks without MPI (job.spare_ranks); srun itself and the warm spares are left out."""
    out = subprocess.run(["pgrep", "-f", f"trainer --run-dir {run_dir}"], capture_output=True, text=True).stdout
    for pid in out.split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--spare" in argv or argv[0].endswith(b"srun"):
            continue
        spawned = any(item.startswith(b"HPC_SPAWN_WORLD=") for item in environ)
        if f"PMI_RANK={rank}".encode() in environ or (spawned and f"SLURM_PROCID={rank}".encode() in environ):
            return int(pid)
    return None


def submit_args(run_dir: Path, data: Path, sets: list[str], *extra: str) -> list[str]:
    args = [sys.executable, "-m", "hpc.submit", "tiny", "--run-dir", str(run_dir), "--set", f"data.path={data}"]
    for s in sets:
        args += ["--set", s]
    return args + list(extra)


LOCAL_SETS: list[str] = []  # --spares: the local runs', the Slurm kills' and the lost nodes' own
KILL_AT = [20]  # the step after which a rank is killed or a node lost (--kill-at)


def one(method: str, data: Path, work: Path) -> dict:
    run_dir = work / f"{method}-{time.monotonic_ns()}"
    local = method == "local-kill"
    proc = None
    if local:
        proc = subprocess.Popen(submit_args(run_dir, data, SETS + LOCAL_SETS, "--local"), cwd=ROOT,
                                stdout=subprocess.DEVNULL)  # fmt: skip
    else:
        sh(*submit_args(run_dir, data, SETS + (LOCAL_SETS if method == "kill" else [])), cwd=ROOT)
        job = json.loads((run_dir / "jobs.jsonl").read_text().splitlines()[-1])["job_id"]
    wait(lambda: any(r.get("step", 0) >= KILL_AT[0] for r in lines(run_dir / "metrics.jsonl")))
    issued = time.time()  # trainer and launcher event times come from time.time() on this same host
    if method == "requeue":
        sh("scancel", "--signal=USR2", job)
    else:
        os.kill(wait(lambda: rank_pid(run_dir, 1), every=0.02), signal.SIGKILL)
    resume, first = resumed(run_dir)
    restarts = [e for e in lines(run_dir / "history.jsonl") if e["event"] in (EVENT_RESTART, EVENT_REJOIN)]
    if proc is not None:  # as Ctrl-C: the launcher stops its mpirun and waits for the ranks (a SIGTERM would end
        proc.send_signal(signal.SIGINT)  # the launcher alone, and the ranks would train on into the next run)
        proc.wait()
    else:
        subprocess.run(["scancel", job], check=False)
        forget_memory(run_dir)
    return {
        "method": method,
        "restart_decided_s": restarts[0]["time"] - issued if restarts else None,
        "resumed_s": resume["time"] - issued,
        "first_new_step_s": first["time"] - issued,
        "startup_s": resume.get("startup_s", {}),
        "steps_lost": resume.get("discarded_records"),  # the steps recorded before the loss, trained again
        "restored_from": resume.get("restored_from", {}).get("from", "durable"),
    }


def forget_memory(run_dir: Path) -> None:
    """A job cancelled outright leaves its checkpoints in node memory (the site's /dev/shm clean-up removes them at
    the job's end); the bench's nodes share this host's /dev/shm, so it removes them itself (after scancel, once the
    ranks have had a moment to go)."""
    if not any(s.startswith("checkpoint.memory_every_steps=") for s in SETS):
        return
    time.sleep(2)
    remove_run("/dev/shm", read_identity(RunDir(run_dir).identity).run_id)


def resumed(run_dir: Path, timeout: float = 180.0) -> tuple[dict, dict]:
    """The run's first ``resume`` event and the metrics record of the first step after it, once both exist."""
    resume = wait(lambda: [e for e in lines(run_dir / "history.jsonl") if e["event"] == EVENT_RESUME],
                  every=0.02, timeout=timeout)[0]  # fmt: skip
    first = wait(lambda: [r for r in lines(run_dir / "metrics.jsonl") if r["step"] == resume["step"] + 1])[0]
    return resume, first


def launch_nodes(run_dir: Path) -> list[str]:
    """The Slurm nodes of the ranks, in rank order, from the first line of each rank's log."""
    nodes = []
    for path in sorted((run_dir / "logs").glob("rank_*.log")):
        first = path.read_text(errors="replace").splitlines()[:1]
        nodes.append(first[0].split("(slurm node ")[1].split(")")[0] if first and "(slurm node " in first[0] else "")
    return nodes


def node_loss(method: str, data: Path, work: Path, state: Path) -> dict:
    """Lose the second node of the launch at step 20 (cluster.sh node-down); bring it back when the run has a new
    step, and wait until Slurm has it idle again for the next repetition."""
    run_dir = work / f"{method}-{time.monotonic_ns()}"
    sh(*submit_args(run_dir, data, [*NODE_SETS, *NODE_SHAPES[method], *LOCAL_SETS]), cwd=ROOT)
    wait(lambda: any(r.get("step", 0) >= KILL_AT[0] for r in lines(run_dir / "metrics.jsonl")))
    # the second node: the first holds the batch step (the driver, the keeper), the last the first warm spare
    node = wait(lambda: (lambda n: n[1] if len(n) >= 2 and all(n) else None)(launch_nodes(run_dir)))
    lost = time.time()
    sh("bash", "envs/slurm/cluster.sh", "node-down", node, str(state), cwd=ROOT)
    try:
        resume, first = resumed(run_dir, timeout=600)
    finally:
        for job in {json.loads(x)["job_id"] for x in (run_dir / "jobs.jsonl").read_text().splitlines()}:
            subprocess.run(["scancel", job], check=False)
        forget_memory(run_dir)
        sh("bash", "envs/slurm/cluster.sh", "node-up", node, str(state), cwd=ROOT)
        usable = ("idle", "mixed", "allocated")  # Slurm took it back (ReturnToService=2), maybe after a DOWN
        try:
            wait(lambda: node_state(node) in usable, timeout=180)
        except TimeoutError:
            print(f"warning: {node} not back in service after 180 s: {node_state(node) or 'no answer'}")
    events = lines(run_dir / "history.jsonl")
    hangs = [e for e in events if e["event"] == EVENT_HANG]
    start = next(e for e in events if e["event"] == "start")
    restarts = [e for e in events if e["event"] in (EVENT_RESTART, EVENT_REJOIN)]
    return {
        "method": method,
        "lost_node": node,
        "survivors_stopped_s": hangs[0]["time"] - lost if hangs else None,
        "restart_decided_s": restarts[0]["time"] - lost if restarts else None,
        "resumed_s": resume["time"] - lost,
        "first_new_step_s": first["time"] - lost,
        "continued_in": "the same job" if (resume.get("slurm_job_id"), resume.get("slurm_restart_count", 0)) ==
                        (start.get("slurm_job_id"), start.get("slurm_restart_count", 0)) else
                        f"job {resume.get('slurm_job_id')} (restart count {resume.get('slurm_restart_count', 0)})",
        "nodes_after": resume.get("nodes"),
        "startup_s": resume.get("startup_s", {}),
        "steps_lost": resume.get("discarded_records"),  # the steps recorded before the loss, trained again
        "restored_from": resume.get("restored_from", {}).get("from", "durable"),
    }  # fmt: skip


def node_state(node: str) -> str:
    """Slurm's state of ``node`` ("" while the controller does not answer, as right after a node comes back); sinfo
    prints it once per partition the node is in."""
    cmd = ["sinfo", "-h", "-N", "-n", node, "-o", "%T"]
    lines = subprocess.run(cmd, capture_output=True, text=True).stdout.split()
    return lines[0] if lines else ""


def resumes(run_dir: Path) -> int:
    return sum(1 for e in lines(run_dir / "history.jsonl") if e["event"] == EVENT_RESUME)


class StepTail:
    """The newest step in a run's metrics.jsonl, read from where the last look ended: the goodput runs' watch reads
    each record once (reading the whole file ten times a second took 16% of a core by step 15,000, from the killed
    run alone)."""

    def __init__(self, path: Path) -> None:
        self.path, self.pos, self.step = path, 0, 0

    def reached(self, step: int) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return False
        end = data.rfind(b"\n") + 1  # whole lines only
        for line in data[:end].splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self.step = max(self.step, int(json.loads(line)["step"]))
        self.pos += end
        return self.step >= step


def kill_every(run_dir: Path, proc: subprocess.Popen, every: int, steps: int) -> int:
    """SIGKILL a rank each time the run passes another ``every`` steps, before its last step (a kill after that hits
    the teardown, not the training: rank 1, else the first of the launcher's rank processes after rank 0 still
    there); the number of kills."""
    kills, tail = 0, StepTail(run_dir / "metrics.jsonl")
    while every and proc.poll() is None and (kills + 1) * every < steps:
        target = (kills + 1) * every
        wait(lambda t=target: proc.poll() is not None or tail.reached(t), timeout=3600, every=0.5)
        pid = next((p for p in (rank_pid(run_dir, r) for r in range(1, 64)) if p), None)
        if proc.poll() is None and pid:
            os.kill(pid, signal.SIGKILL)
            kills += 1
            wait(lambda k=kills: proc.poll() is not None or resumes(run_dir) >= k, timeout=600)
    return kills


def productive_s(run_dir: Path) -> float:
    """Step time of the steps that count: the last record of each step (a step recomputed after a kill counts once,
    the first time is lost), evaluations included."""
    last = {r["step"]: r for r in lines(run_dir / "metrics.jsonl")}
    return sum(r["step_time_s"] + r.get("time_eval_s", 0.0) for r in last.values())


def run_goodput(run_dir: Path, wall_s: float) -> dict:
    productive = productive_s(run_dir)
    return {"productive_s": productive, "goodput": productive / wall_s}


def goodput(data: Path, work: Path, steps: int, every: int) -> dict:
    sets = [s for s in SETS if not s.startswith("train.steps=")] + [f"train.steps={steps}"]
    sets += ["checkpoint.every_steps=50", f"job.max_failures={steps // every + 1}"]
    out = {}
    for label, interval in (("uninterrupted", 0), ("killed", every)):
        run_dir = work / f"goodput-{label}"
        start = time.time()
        proc = subprocess.Popen(submit_args(run_dir, data, sets + LOCAL_SETS, "--local"), cwd=ROOT,
                                stdout=subprocess.DEVNULL)  # fmt: skip
        kills = kill_every(run_dir, proc, interval, steps)
        status = proc.wait()
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
        wall = time.time() - start
        out[label] = {"wall_s": wall, "status": status, "kills": kills, **run_goodput(run_dir, wall),
                      "params_sha256": summary.get("params_sha256")}  # fmt: skip
    out.update(summarize_goodput(out["uninterrupted"], out["killed"]))
    out["steps"], out["kill_every"] = steps, every
    return out


def summarize_goodput(plain: dict, killed: dict) -> dict:
    """The killed run's goodput, what each kill cost (lost time beyond the uninterrupted run's own overhead:
    start-up, teardown), the wall-time ratio, and whether both runs ended with the same parameters."""
    lost = (killed["wall_s"] - killed["productive_s"]) - (plain["wall_s"] - plain["productive_s"])
    return {
        "goodput": killed["goodput"],
        "goodput_uninterrupted": plain["goodput"],
        "cost_per_kill_s": lost / killed["kills"] if killed["kills"] else None,
        "wall_ratio": plain["wall_s"] / killed["wall_s"],
        "same_params": plain["params_sha256"] == killed["params_sha256"],
    }


KEYS = ("survivors_stopped_s", "restart_decided_s", "resumed_s", "first_new_step_s", "steps_lost")


def main() -> int:
    p = bench_parser(__doc__)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--goodput-steps", type=int, default=0, help="steps of the goodput runs (0: skip them)")
    p.add_argument("--kill-every", type=int, default=1000, help="steps between kills in the goodput run")
    p.add_argument("--no-slurm", action="store_true", help="only the local measurements")
    p.add_argument("--kill-at", type=int, default=20, help="the step after which the rank or node is lost")
    p.add_argument("--memory-every", type=int, default=0, help="checkpoint.memory_every_steps of every run (0: off)")
    p.add_argument("--spares", type=int, default=0, help="job.spare_ranks of the local runs (0: off)")
    add_slurm_options(p, METHODS)
    args = p.parse_args()
    KILL_AT[0] = args.kill_at
    if args.memory_every:
        SETS.append(f"checkpoint.memory_every_steps={args.memory_every}")
        NODE_SETS.append(f"checkpoint.memory_every_steps={args.memory_every}")
    if args.spares:  # in-process restarts: the local kill, the Slurm kill and the local goodput runs
        LOCAL_SETS.append(f"job.spare_ranks={args.spares}")
    methods = chosen_methods(p, args.methods, METHODS)
    if args.no_slurm:
        methods = [m for m in methods if m == "local-kill"]
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    from trainer.data.prepare import PrepareSpec, prepare

    data = work / "data"
    prepare(PrepareSpec(source="stdlib", include=("*.py",), max_source_bytes=2_000_000, val_fraction=0.1,
                        shard_tokens=400_000), data)  # fmt: skip
    rows = interruptions(args, methods, data, work)
    setup = {"reps": args.reps, "methods": methods, "config": SETS, "memory_every": args.memory_every,
             "kill_at": args.kill_at, "spares": args.spares}  # fmt: skip
    result = {"benchmark": "recovery", "setup": setup, "summary": medians(rows), "runs": rows}
    if args.goodput_steps:
        result["goodput"] = goodput(data, work, args.goodput_steps, args.kill_every)
    emit(result, args.json, show)
    return 0


def interruptions(args: argparse.Namespace, methods: list[str], data: Path, work: Path) -> list[dict]:
    """Every repetition of the chosen methods: local-kill here, kill and requeue on the bench's Slurm cluster (or
    ``--slurm-conf``'s), the node losses on a cluster of separate hosts of its own."""
    rows = [one("local-kill", data, work) for _ in range(args.reps)] if "local-kill" in methods else []
    on_slurm = [m for m in methods if m not in ("local-kill", *NODE_METHODS)]
    if on_slurm:
        with slurm_cluster(PORTS, args.slurm_conf):
            rows += [one(m, data, work) for _ in range(args.reps) for m in on_slurm]
    on_hosts = [m for m in methods if m in NODE_METHODS]
    if on_hosts:  # always its own cluster: --slurm-conf's is not one of separate hosts
        with slurm_cluster(HOSTS) as state:
            rows += [node_loss(m, data, work, state) for _ in range(args.reps) for m in on_hosts]
    return rows


def medians(rows: list[dict]) -> dict[str, dict]:
    """Per method, in the order first run: each of KEYS' median over the repetitions that have it (None if none)."""
    summary = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        summary[method] = {k: statistics.median(r[k] for r in mine if r.get(k) is not None)
                           if any(r.get(k) is not None for r in mine) else None for k in KEYS}  # fmt: skip
    return summary


def show(result: dict) -> None:
    print(
        f"\n{'interruption':14} " + " ".join(f"{k:>18}" for k in KEYS) + "   (medians, seconds after the kill/signal)"
    )
    for method, med in result["summary"].items():
        print(f"{method:14} " + " ".join(f"{'-' if v is None else f'{v:.2f}':>18}" for v in med.values()))
    memory = result["setup"].get("memory_every") or "off"
    print(f"(steps_lost: steps recorded before the loss, trained again; checkpoint.memory_every_steps: {memory})")
    if "goodput" in result:
        g = result["goodput"]
        print(f"\ngoodput: {g['steps']} steps, a rank killed every {g['kill_every']} steps ({g['killed']['kills']} "
              f"kills): {100 * g['goodput']:.1f} % of the killed run's {g['killed']['wall_s']:.1f} s trained steps "
              f"that count ({100 * g['goodput_uninterrupted']:.1f} % of the uninterrupted run's "
              f"{g['uninterrupted']['wall_s']:.1f} s); {g['cost_per_kill_s']:.1f} s lost per kill; wall-time ratio "
              f"{100 * g['wall_ratio']:.1f} %; same params_sha256: {g['same_params']}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
