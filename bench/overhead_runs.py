"""bench/overhead.py's runs: every variant once a round, each followed from outside while it trains (its step
count, its processes' CPU time) and read back afterwards (step times, exposed communication, parameter count)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import nanogpt  # bench/nanogpt.py (bench/ on sys.path)
from common import (
    LINK_IFNAME,
    LINK_IPS,
    ROOT,
    busy_cpu_s,
    children_cpu_s,
    process_tree,
    tree_cpu_s,
    wait_for_quiet,
)
from overhead_variants import NANO, PLAIN_PROGRESS, command

from rundir.contract import NODE_WRAP_VAR

RUN_CPU = "cpu_per_step_s"  # a run's CPU seconds per step, all its processes together


def run_rounds(
    args: argparse.Namespace, variants: tuple[str, ...], overrides: list[str], work: Path
) -> dict[str, list[dict]]:
    """Every round runs each variant once, the order rotated per round; returns the post-warm-up step times."""
    env = runs_env(args)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for rnd in range(args.rounds):
        k = rnd % len(variants)
        for variant in variants[k:] + variants[:k]:  # rotate, so no variant always runs first
            runs[variant].append(one_run(variant, rnd, args, overrides, work, env))
    return runs


def runs_env(args: argparse.Namespace) -> dict[str, str]:
    """Every run's environment: the repository importable, ``--threads`` threads a rank, plain_layouts.py's nodes
    simulated on this host; over an emulated link, the trainer's per-node prefix and plain's rendezvous on it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["PLAIN_RANKS_PER_NODE"] = str(args.ranks)  # plain_layouts.py's nodes, simulated on this host
    if args.namespaces:
        env[NODE_WRAP_VAR] = "|".join(f"ip netns exec {ns}" for ns in args.namespaces)
        env["GLOO_SOCKET_IFNAME"] = LINK_IFNAME
        env["MASTER_ADDR"], env["MASTER_PORT"] = LINK_IPS[0], str(29500 + os.getpid() % 1000)  # plain's
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns it cannot resolve the veth addresses' names
    return env


def one_run(
    variant: str, rnd: int, args: argparse.Namespace, overrides: list[str], work: Path, env: dict[str, str]
) -> dict:
    """One run of ``variant`` in round ``rnd`` on a quiet machine, the dataset in the page cache: its figures
    (RuntimeError if it fails); prints its progress line."""
    folder = work / f"{variant}-r{rnd}"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / ("launch.log" if variant in NANO else "times.json" if variant == "plain" else "run")
    cwd = args.nanogpt_folders[variant] if variant in NANO else ROOT  # nanoGPT reads its files from its cwd
    wait_for_quiet()
    warm_page_cache(args.data)
    t0, busy0, own0 = time.perf_counter(), busy_cpu_s(), children_cpu_s()
    cmd = command(variant, args, overrides, out)
    run_env = {**env, "PYTHONUNBUFFERED": "1"} if variant in NANO else env  # its iter lines, live
    log = folder / "launch.log"
    returncode, cpu_step = run_measured(variant, cmd, out, log, args.skip, env=run_env, cwd=cwd)
    wall = time.perf_counter() - t0
    other = (busy_cpu_s() - busy0 - (children_cpu_s() - own0)) / wall  # cores used by other processes
    if returncode != 0:
        raise RuntimeError(f"{variant} round {rnd} failed ({returncode}); see {folder / 'launch.log'}")
    times = step_times(variant, out)[args.skip :]
    run = {
        "round": rnd,
        "wall_s": wall,
        "other_load": other,
        "median_step_s": statistics.median(times),
        RUN_CPU: cpu_step,
        "steps": times,
        "comm": step_times(variant, out, "time_comm_s")[args.skip :],
        "comm_busy": step_times(variant, out, "comm_busy_s")[args.skip :],  # where the trainer's own hook ran
        "n_params": n_params(variant, rnd, out),
    }
    cpu = f", {cpu_step:.3f} CPU-s a step" if cpu_step is not None else ""
    print(
        f"round {rnd + 1}/{args.rounds} {variant:<18} median step {1e3 * run['median_step_s']:6.1f} ms{cpu} "
        f"(run {wall:.1f} s, other processes used {other:.2f} cores)"
    )
    return run


def n_params(variant: str, rnd: int, out: Path) -> int | None:
    """The run's parameter count (None for plain); nanoGPT's run must have used AdamW fused as asked."""
    if variant in NANO:
        if nanogpt.fused_adamw(out) != (variant == "nanogpt-fused"):
            raise RuntimeError(f"{variant} round {rnd}: AdamW fused is not as asked; see {out}")
        return nanogpt.n_params(out)
    if variant != "plain":
        return json.loads((out / "summary.json").read_text()).get("n_params")
    return None


def step_times(variant: str, out: Path, key: str = "step_time_s") -> list[float]:
    """Per-step ``key`` (``step_time_s``; ``time_comm_s``: the trainer's exposed communication, None for plain)."""
    if variant == "plain":
        return [float(x) for x in json.loads(out.read_text())["step_time_s"]] if key == "step_time_s" else []
    if variant in NANO:  # ``out`` is its launch log: rank 0's per-iteration lines
        return nanogpt.step_times(out) if key == "step_time_s" else []
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [float(r[key]) for r in records if key in r]


def steps_done(variant: str, out: Path) -> int:
    """The steps the run has finished so far, from the file its rank 0 appends to after every step."""
    path = out if variant in NANO else {"plain": out.with_name(PLAIN_PROGRESS)}.get(variant, out / "metrics.jsonl")
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return 0
    if variant in NANO:
        return len(nanogpt.ITER_RE.findall(text))
    if variant == "plain":
        return text.count("\n")
    complete = text[: text.rfind("\n")].rsplit("\n", 1)[-1]  # the newest whole record (every train.log_every steps)
    try:
        return int(json.loads(complete)["step"]) if complete else 0
    except (ValueError, KeyError, TypeError):
        return 0


def run_measured(variant: str, cmd: list[str], out: Path, log: Path, skip: int, **kw) -> tuple[int, float | None]:
    """Runs ``cmd``; returns its exit status and the CPU seconds that its whole process tree (launcher, ranks, their
    threads) used per step between step ``skip`` and the last step but one: the work a step costs, which together
    with the step time tells work from waiting. Polls the step count every 20 ms and samples the ranks' CPU
    (/proc/PID/stat) when it changes; None if fewer than 5 steps fell between the samples."""
    samples: list[tuple[int, float]] = []
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=f, **kw)
        pids: list[int] = []
        while proc.poll() is None:
            done = steps_done(variant, out)
            if done >= 1 and (not samples or done != samples[-1][0]):
                if done <= skip or not pids:  # every rank is up by the first step; refreshed up to the window
                    pids = process_tree(proc.pid)
                samples.append((done, tree_cpu_s(pids)))
            time.sleep(0.02)
    last = steps_done(variant, out)
    window = [(n, cpu) for n, cpu in samples if skip <= n < last]
    if len(window) < 2 or window[-1][0] - window[0][0] < 5:
        return proc.returncode, None
    (n0, cpu0), (n1, cpu1) = window[0], window[-1]
    return proc.returncode, (cpu1 - cpu0) / (n1 - n0)


def warm_page_cache(folder: Path) -> None:
    """Read the dataset's files so both sides find them in the page cache (this VM's DAMON pages out page cache
    left unused for ~30 s, and a cold window read costs ~0.2 ms more, unequally between variants)."""
    for path in sorted(folder.glob("*.h5")):
        with open(path, "rb") as f:
            while f.read(1 << 22):
                pass
