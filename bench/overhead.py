"""Tokens/s of this trainer vs plain torch DDP (bench/plain_ddp.py under torchrun): same model, data and batch; with
``--layout fsdp|hsdp|tp-fsdp|pp``, vs the plain script of that layout (bench/plain_layouts.py).

Runs, alternated round by round so machine noise hits every variant alike:

- ``plain``: ``torchrun --standalone --nproc-per-node N*R bench/plain_ddp.py``
- ``trainer-flat`` / ``trainer-hier``: ``python -m hpc.submit tiny --local`` with comm.allreduce=flat / hierarchical
  (trainer-hier only with more than one node and more than one rank per node: otherwise the trainer uses DDP's flat
  all-reduce and the variant would repeat trainer-flat)
- ``trainer-hier-sync``: trainer-hier with ``comm.overlap=false`` (the three phases inside DDP's hook, blocking
  backward, instead of on the reducer's thread while backward goes on)
- ``trainer-hier-pipe``: trainer-hier with ``comm.chunk_kb=1024`` (the phases pipelined over 1 MiB chunks)
- ``trainer-hier-bf16``: trainer-hier with ``comm.compress=bf16`` (the inter-node phase in bfloat16)
- ``trainer-auto`` / ``trainer-leader``: comm.allreduce=auto (measured at start-up, per bucket size) / leader
- ``trainer-auto-flat``: trainer-auto given a plan that picks flat for every bucket (``comm.plan_from``, a file the
  benchmark writes), apart from which algorithms auto's measurement chose: since an all-flat plan registers no hook
  (DDP's own all-reduce runs, trainer/build.py ``plan_allreduce``), it should match trainer-flat
- ``trainer-auto-small``: trainer-auto with comm.bucket_mb=0.25 (the tiny model's gradients fit one 25 MB bucket,
  which is ready only when backward ends: nothing can overlap; small buckets let the reduction start earlier)
- ``trainer-agree-separate``: trainer-flat with ``comm.carry_agreement=false``: the ranks' agreement on loss, stop
  and checkpoint trigger in an all-reduce of its own, read at the next step boundary (``comm.defer_agreement``),
  instead of carried in the gradient reduction
- ``trainer-agree-sync``: trainer-agree-separate with ``comm.defer_agreement=false`` (every step waits for that
  all-reduce)
- ``trainer-quiet``: trainer-flat with TensorBoard, straggler checks and the hang watchdog off (their cost)
- ``trainer-recipe``: trainer-flat entering through the user-recipe door: the same GPT and data from a user-style
  recipe module (bench/recipes/user_gpt.py, copied next to a config written into the work folder with
  ``recipe: user_gpt:recipe`` and the model's shape as ``recipe_args``), submitted like the others
- ``trainer-untracked``: trainer-flat with ``tracking.backend=off`` (no tracker process: the embedded MLflow's cost)
- ``trainer-nodims``: trainer-flat with ``monitor.comm_by_dim=false`` (no per-collective timing in the mesh layouts:
  the communication ledger's cost)
- ``trainer-replicas``: trainer-flat with the replicas' weights compared at every step
  (``monitor.replica_check_every=1``, the dearest setting: a check every N steps costs 1/N of the difference)
- ``nanogpt`` (with ``--nanogpt DIR``, a checkout of karpathy/nanoGPT): its ``train.py`` under torchrun on the same
  prepared data, model shape, batch, optimizer and schedule, with two edits so that it runs on CPU
  (bench/nanogpt.py); its parameter count is checked against the trainer's
- ``nanogpt-fused``: nanogpt with one more edit, AdamW's fused kernels on CPU too (it asks for them on CUDA only), as
  the trainer's default ``train.optimizer_impl`` runs: the same kernels on both sides

``--layout`` other than ``ddp``: ``plain`` is bench/plain_layouts.py's script of that layout, every trainer
variant gets the layout's ``parallel.*`` settings (bench/parallel.py's ``LAYOUTS``), and only the variants that
mean something outside DDP run (plain, trainer-flat, trainer-quiet, trainer-untracked, trainer-nodims).

all on N simulated nodes x R ranks (``--nodes``, ``--ranks``; default 1 x 2) on this host, 1 thread per rank, eval
off. ``--link-mbit RATE`` (root, 2 nodes) runs each node's ranks in a network namespace of its own, the two joined
by a link shaped to RATE (bench/common.py ``emulated_link``), so the inter-node traffic is as slow as between real
nodes: the trainer through the local launcher's per-node prefix (HPC_LOCAL_NODE_WRAP), plain DDP through mpirun.
The first ``--skip`` steps of every run are warm-up; the figure is the median step time over the remaining
steps of all rounds. "CPU-s" is the CPU time a step costs, every process of the run together (sampled from
/proc while the run trains): with the step time, it tells work from waiting. "comm ms" is the trainer's exposed
communication per step; "hidden" the share of its own hook's whole reduction time that overlapped with backward.
Prints a table and a JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mpi4py
import nanogpt  # bench/nanogpt.py
import parallel  # bench/parallel.py: the layouts' settings
import yaml
from common import (  # bench/common.py (bench/ on sys.path)
    LINK_IFNAME,
    LINK_IPS,
    OTHER_LOAD_LIMIT,
    add_quiet_wait_option,
    busy_cpu_s,
    children_cpu_s,
    emulated_link,
    process_tree,
    set_quiet_wait,
    tree_cpu_s,
    wait_for_quiet,
)

mpi4py.rc.initialize = False  # trainer.data imports mpi4py; this process only orchestrates, MPI runs in the children
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from runconfig import RunConfig, load_config  # noqa: E402
from runconfig.load import load_raw  # noqa: E402
from rundir.contract import NODE_WRAP_VAR  # noqa: E402
from rundir.paths import RunDir  # noqa: E402
from tracking import create_store, resolve  # noqa: E402
from trainer.data.prepare import prepare  # noqa: E402
from trainer.data.resolve import dataset_folder, prepare_spec  # noqa: E402
from trainer.env import DATA_CACHE_VAR  # noqa: E402

ALL_VARIANTS = (
    "plain", "trainer-flat", "trainer-hier", "trainer-hier-sync", "trainer-hier-pipe", "trainer-hier-bf16",
    "trainer-quiet", "trainer-recipe", "trainer-agree-sync", "trainer-agree-separate", "trainer-auto",
    "trainer-auto-flat", "trainer-leader", "trainer-auto-small", "trainer-optim-loop", "trainer-replicas",
    "trainer-untracked", "trainer-nodims", "nanogpt", "nanogpt-fused",
)  # fmt: skip
NANO = ("nanogpt", "nanogpt-fused")
HIER = (
    "trainer-hier",
    "trainer-hier-sync",
    "trainer-hier-pipe",
    "trainer-hier-bf16",
    "trainer-auto",
    "trainer-auto-flat",
    "trainer-leader",
    "trainer-auto-small",
)
VARIANTS = ALL_VARIANTS  # narrowed in main() to those that differ for the layout
# trainer-quiet: flat all-reduce with TensorBoard, straggler checks and the hang watchdog off (the step clock stays):
# the cost of the monitors, side by side.
QUIET = ["monitor.tensorboard=false", "monitor.straggler_every=0", "monitor.hang_timeout_s=0"]
# trainer-optim-loop: flat, with AdamW's per-parameter loop (train.optimizer_impl=for-loop: nanoGPT's path on CPU)
# instead of the fused kernels of the default.
# trainer-recipe: the user-style recipe module (copied next to the config the benchmark writes) and its function.
USER_RECIPE = ROOT / "bench" / "recipes" / "user_gpt.py"
USER_RECIPE_SPEC = "user_gpt:recipe"
TARGET = 0.98
# Outside DDP (--layout): the plain peer, the trainer as configured, and the trainer with its monitors off.
LAYOUT_VARIANTS = ("plain", "trainer-flat", "trainer-quiet", "trainer-untracked", "trainer-nodims")
PLAIN_LAYOUTS = ("fsdp", "hsdp", "tp-fsdp", "pp")  # bench/plain_layouts.py's --layout
PLAIN_NAMES = {"ddp": "bench/plain_ddp.py", **{k: f"bench/plain_layouts.py --layout {k}" for k in PLAIN_LAYOUTS}}
RUN_CPU = "cpu_per_step_s"  # a run's CPU seconds per step, all its processes together
PLAIN_PROGRESS = "progress.txt"  # plain_ddp.py's live step count, beside its times.json


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help="config file or example name (default tiny)")
    p.add_argument("--nodes", type=int, default=1, help="simulated nodes (default 1)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument(
        "--layout",
        default="ddp",
        choices=("ddp", *PLAIN_LAYOUTS),
        help="the parallel layout of both sides (default ddp; the others against bench/plain_layouts.py)",
    )
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    p.add_argument("--skip", type=int, default=10, help="warm-up steps left out of every run (default 10)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every variant (default 3)")
    p.add_argument(
        "--variants",
        help=f"comma-separated subset of {','.join(ALL_VARIANTS[1:])} to run (plain, the reference, always runs)",
    )
    p.add_argument("--data", type=Path, help="prepared dataset folder (default: the config's, prepared if missing)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--work-dir", type=Path, help="keep run directories and logs here (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="also write the JSON result to this file")
    p.add_argument("--link-mbit", type=float, help="emulate 2 real nodes joined by a link of this rate (root)")
    add_quiet_wait_option(p)
    p.add_argument(
        "--nanogpt",
        type=Path,
        metavar="DIR",
        help="also run karpathy's nanoGPT from this checkout (its train.py, model.py, configurator.py) side by side",
    )
    args = p.parse_args(argv)
    args.namespaces = ()
    if args.steps <= args.skip:
        p.error("--steps must be larger than --skip")
    if args.layout not in ("ddp", "fsdp") and (args.nodes < 2 or args.ranks < 2):
        p.error(f"--layout {args.layout} needs 2 or more nodes (--nodes) of 2 or more ranks (--ranks)")
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
    return args


def data_folder(args: argparse.Namespace, overrides: list[str]) -> Path:
    """The prepared dataset both sides read; prepared here (before any timing) if it is missing."""
    if args.data:
        return args.data.resolve()
    cfg = load_config(args.config, overrides)
    cache = Path(os.environ.get(DATA_CACHE_VAR) or Path.home() / ".cache" / "hpc-trainer" / "data")
    folder = dataset_folder(cfg.data, cache)
    if not (folder / "manifest.json").is_file():
        print(f"preparing {cfg.data.source} into {folder} (first use)")
        prepare(prepare_spec(cfg.data), folder)
    return folder


def write_user_recipe(args: argparse.Namespace, overrides: list[str], folder: Path) -> Path:
    """The trainer-recipe variant's project folder, as a user would lay it out: the recipe module next to its
    config. The config is the benchmark's (``--config`` with the ``model.*`` overrides applied) with the ``model``
    section moved into ``recipe_args`` of ``recipe: user_gpt:recipe``; the other overrides are passed with
    ``--set`` like the other variants'. Returns the config file."""
    model_sets = [kv for kv in overrides if kv.startswith("model.")]
    raw, _ = load_raw(args.config, model_sets)
    shape = load_config(args.config, model_sets).model  # defaults filled in, validated
    raw.pop("model", None)
    raw["recipe"] = USER_RECIPE_SPEC
    raw["recipe_args"] = dataclasses.asdict(shape)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(USER_RECIPE, folder / USER_RECIPE.name)
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    return config


def torchrun_style(args: argparse.Namespace, script: list[str]) -> list[str]:
    """``script`` (a python command line) on every rank with torchrun's environment: torchrun on one host; over an
    emulated link, mpirun with one MPMD segment per emulated node and torchrun's variables taken from MPICH's."""
    if args.namespaces:
        rank_env = ["sh", "-c", 'RANK=$PMI_RANK WORLD_SIZE=$PMI_SIZE LOCAL_RANK=0 exec "$@"', "sh"]
        cmd = [str(Path(sys.executable).parent / "mpirun")]
        for i, ns in enumerate(args.namespaces):
            cmd += [":"] if i else []
            cmd += ["-n", str(args.ranks), "ip", "netns", "exec", ns, *rank_env, *script]
        return cmd
    nproc = f"--nproc-per-node={args.nodes * args.ranks}"
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", nproc, *script[1:]]


def command(variant: str, args: argparse.Namespace, overrides: list[str], out: Path) -> list[str]:
    sets = [a for kv in overrides for a in ("--set", kv)]
    if variant == "plain":
        script = [sys.executable, str(ROOT / "bench" / "plain_ddp.py"), "--config", args.config]
        if args.layout != "ddp":
            script = [sys.executable, str(ROOT / "bench" / "plain_layouts.py"), "--layout", args.layout]
            script += ["--config", args.config]
        progress = ["--progress", str(out.with_name(PLAIN_PROGRESS))]
        return torchrun_style(args, [*script, "--data", str(args.data), *sets, "--out", str(out), *progress])
    if variant in NANO:
        return torchrun_style(args, nanogpt.command(args.nanogpt_folders[variant], sys.executable))
    auto = ("trainer-auto", "trainer-auto-flat", "trainer-auto-small")
    allreduce = {**dict.fromkeys(auto, "auto"), "trainer-leader": "leader"}.get(variant, "hierarchical")
    allreduce = allreduce if variant in HIER else "flat"
    config = args.config
    if variant == "trainer-recipe":  # the model's shape is in the written config's recipe_args
        config = str(args.recipe_config)
        sets = [a for kv in overrides if not kv.startswith("model.") for a in ("--set", kv)]
    submit = [sys.executable, "-m", "hpc.submit", config, "--local", "--run-dir", str(out)]
    quiet = [a for kv in QUIET for a in ("--set", kv)] if variant == "trainer-quiet" else []
    sync = ["--set", "comm.overlap=false"] if variant == "trainer-hier-sync" else []
    sync += ["--set", "comm.compress=bf16"] if variant == "trainer-hier-bf16" else []
    sync += ["--set", "comm.chunk_kb=1024"] if variant == "trainer-hier-pipe" else []
    separate = variant in ("trainer-agree-separate", "trainer-agree-sync")
    sync += ["--set", "comm.carry_agreement=false"] if separate else []
    sync += ["--set", "comm.defer_agreement=false"] if variant == "trainer-agree-sync" else []
    sync += ["--set", "comm.bucket_mb=0.25"] if variant == "trainer-auto-small" else []
    sync += ["--set", "train.optimizer_impl=for-loop"] if variant == "trainer-optim-loop" else []
    sync += ["--set", "monitor.replica_check_every=1"] if variant == "trainer-replicas" else []
    sync += ["--set", "tracking.backend=off"] if variant == "trainer-untracked" else []
    sync += ["--set", "monitor.comm_by_dim=false"] if variant == "trainer-nodims" else []
    sync += ["--set", f"comm.plan_from={args.flat_plan}"] if variant == "trainer-auto-flat" else []
    link = ["--set", f"comm.master_addr={LINK_IPS[0]}"] if args.namespaces else []
    return [*submit, *sets, "--set", f"comm.allreduce={allreduce}", *quiet, *sync, *link]


def step_times(variant: str, out: Path, key: str = "step_time_s") -> list[float]:
    """Per-step ``key`` (``step_time_s``; ``time_comm_s``: the trainer's exposed communication, None for plain)."""
    if variant == "plain":
        return [float(x) for x in json.loads(out.read_text())["step_time_s"]] if key == "step_time_s" else []
    if variant in NANO:  # ``out`` is its launch log: rank 0's per-iteration lines
        return nanogpt.step_times(out) if key == "step_time_s" else []
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [float(r[key]) for r in records if key in r]


def write_flat_plan(args: argparse.Namespace, cfg: RunConfig, path: Path) -> Path:
    """An all-reduce plan (trainer/parallel/autotune.py's format) for this layout and comm settings that picks flat
    for every bucket size: trainer-auto-flat's comm.plan_from."""
    plan = {
        "topology": [args.nodes, args.ranks],
        "compress": cfg.comm.compress == "bf16",
        "chunk_bytes": int(cfg.comm.chunk_kb * 1024),
        "algorithms": ["flat"],
        "sizes": [{"bytes": 1 << 20, "seconds": {}, "choice": "flat"}],  # the nearest row for any size
        "measured_s": 0.0,
        "timing": "not measured: written by bench/overhead.py, flat for every bucket",
    }
    path.write_text(json.dumps(plan))
    return path


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


def run_rounds(args: argparse.Namespace, overrides: list[str], work: Path) -> dict[str, list[dict]]:
    """Every round runs each variant once, the order rotated per round; returns the post-warm-up step times."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["PLAIN_RANKS_PER_NODE"] = str(args.ranks)  # plain_layouts.py's nodes, simulated on this host
    if args.namespaces:
        env[NODE_WRAP_VAR] = "|".join(f"ip netns exec {ns}" for ns in args.namespaces)
        env["GLOO_SOCKET_IFNAME"] = LINK_IFNAME
        env["MASTER_ADDR"], env["MASTER_PORT"] = LINK_IPS[0], str(29500 + os.getpid() % 1000)  # plain's
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns it cannot resolve the veth addresses' names
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for rnd in range(args.rounds):
        k = rnd % len(VARIANTS)
        order = VARIANTS[k:] + VARIANTS[:k]  # rotate, so no variant always runs first
        for variant in order:
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
            comm = step_times(variant, out, "time_comm_s")[args.skip :]
            busy = step_times(variant, out, "comm_busy_s")[args.skip :]  # where the trainer's own hook ran
            median = statistics.median(times)
            if variant in NANO:
                params = nanogpt.n_params(out)
                if nanogpt.fused_adamw(out) != (variant == "nanogpt-fused"):
                    raise RuntimeError(f"{variant} round {rnd}: AdamW fused is not as asked; see {out}")
            elif variant != "plain":
                params = json.loads((out / "summary.json").read_text()).get("n_params")
            else:
                params = None
            runs[variant].append(
                {
                    "round": rnd,
                    "wall_s": wall,
                    "other_load": other,
                    "median_step_s": median,
                    RUN_CPU: cpu_step,
                    "steps": times,
                    "comm": comm,
                    "comm_busy": busy,
                    "n_params": params,
                }
            )
            cpu = f", {cpu_step:.3f} CPU-s a step" if cpu_step is not None else ""
            print(
                f"round {rnd + 1}/{args.rounds} {variant:<18} median step {1e3 * median:6.1f} ms{cpu} "
                f"(run {wall:.1f} s, other processes used {other:.2f} cores)"
            )
    return runs


def summarize(runs: dict[str, list[dict]], tokens_per_step: int) -> dict[str, dict]:
    summary = {}
    for variant in VARIANTS:
        pooled = [t for run in runs[variant] for t in run["steps"]]
        median, p25 = statistics.median(pooled), statistics.quantiles(pooled, n=4)[0]
        summary[variant] = {"median_step_s": median, "p25_step_s": p25, "tokens_per_s": tokens_per_step / median}
        cpu = [run[RUN_CPU] for run in runs[variant] if run.get(RUN_CPU) is not None]
        if cpu:  # the work a step costs, all processes together: the median over rounds
            summary[variant]["cpu_per_step_s"] = statistics.median(cpu)
        comm = [t for run in runs[variant] for t in run["comm"]]
        if comm:  # the trainer's exposed communication per step (not what overlapped with backward)
            summary[variant]["median_exposed_comm_s"] = statistics.median(comm)
        busy = [t for run in runs[variant] for t in run.get("comm_busy", [])]
        if comm and busy:  # the reduction's whole time: the share of it hidden behind backward
            summary[variant]["median_comm_busy_s"] = statistics.median(busy)
            summary[variant]["hidden_share"] = max(0.0, 1 - statistics.median(comm) / statistics.median(busy))
    plain = summary["plain"]
    for variant in VARIANTS:
        s = summary[variant]
        s["ratio_vs_plain"] = plain["median_step_s"] / s["median_step_s"]
        s["ratio_vs_plain_p25"] = plain["p25_step_s"] / s["p25_step_s"]
        if "cpu_per_step_s" in s and "cpu_per_step_s" in plain:
            s["cpu_ratio_vs_plain"] = plain["cpu_per_step_s"] / s["cpu_per_step_s"]
        pairs = zip(runs["plain"], runs[variant], strict=True)
        s["round_ratios"] = [p["median_step_s"] / r["median_step_s"] for p, r in pairs]
    return summary


def print_table(args: argparse.Namespace, cfg: RunConfig, runs: dict[str, list[dict]], summary: dict) -> None:
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
    print(
        f"\n{args.config}, layout {args.layout}: {args.nodes} node(s) x {args.ranks} ranks, "
        f"{args.threads} thread(s)/rank, {args.steps} steps (first {args.skip} skipped), "
        f"{args.rounds} rounds, {tokens_per_step} tokens/step, "
        f"grad accumulation {cfg.grad_accum(args.nodes * args.ranks)}"
        + (f", the 2 nodes joined by an emulated {args.link_mbit:g} Mbit/s link" if args.link_mbit else "")
        + "\n"
        f"ratio = tokens/s / plain's ({PLAIN_NAMES[args.layout]}; target >= {TARGET} for every trainer variant) "
        "from the median step time "
        "over all rounds;\n"
        "p25: the same from the lower-quartile step time (less hit by bursts of machine noise);\n"
        "CPU-s: CPU seconds a step costs, every process of the run together (median over rounds), and plain's / "
        "the variant's:\n  the work per step (slower at the same CPU-s: waiting; at more CPU-s: more work);\n"
        "per round: the round's median step ms / ratio of the round's medians\n"
    )
    head = f"{'variant':<18} | {'median ms':>9} | {'tokens/s':>8} | {'ratio':>5} | {'p25 ms':>6} | {'ratio':>5}"
    head += f" | {'CPU-s':>5} | {'ratio':>5}"
    print(f"{head} | {'comm ms':>7} | {'hidden':>6} | per-round ms / ratio\n" + "-" * 135)
    for variant in VARIANTS:
        s = summary[variant]
        rounds = " ".join(
            f"{1e3 * r['median_step_s']:.0f}/{q:.2f}" for r, q in zip(runs[variant], s["round_ratios"], strict=True)
        )
        comm = f"{1e3 * s['median_exposed_comm_s']:7.1f}" if "median_exposed_comm_s" in s else f"{'-':>7}"
        comm += f" | {100 * s['hidden_share']:5.0f}%" if "hidden_share" in s else f" | {'-':>6}"
        cpu = f"{s['cpu_per_step_s']:>5.3f}" if "cpu_per_step_s" in s else f"{'-':>5}"
        cpu += f" | {s['cpu_ratio_vs_plain']:>5.3f}" if "cpu_ratio_vs_plain" in s else f" | {'-':>5}"
        print(
            f"{variant:<18} | {1e3 * s['median_step_s']:>9.1f} | {s['tokens_per_s']:>8.0f} | "
            f"{s['ratio_vs_plain']:>5.3f} | {1e3 * s['p25_step_s']:>6.1f} | {s['ratio_vs_plain_p25']:>5.3f} | "
            f"{cpu} | {comm} | {rounds}"
        )


def main(argv: list[str] | None = None) -> int:
    global VARIANTS
    args = parse_args(argv)
    set_quiet_wait(args.quiet_wait_s)
    VARIANTS = tuple(v for v in ALL_VARIANTS if not args.variants or v in args.variants)
    if args.layout != "ddp":
        VARIANTS = tuple(v for v in VARIANTS if v in LAYOUT_VARIANTS)
    if not args.nanogpt:
        VARIANTS = tuple(v for v in VARIANTS if v not in NANO)
    if (args.nodes < 2 or args.ranks < 2) and set(HIER) & set(VARIANTS):
        VARIANTS = tuple(v for v in VARIANTS if v not in HIER)
        print(f"{args.nodes} node(s) x {args.ranks} ranks: no trainer-hier (the trainer falls back to flat all-reduce)")
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show up live through a pipe too
    started = time.perf_counter()
    overrides = [
        f"job.nodes={args.nodes}",
        f"job.ranks_per_node={args.ranks}",
        f"job.threads_per_rank={args.threads}",
        f"train.steps={args.steps}",
        "train.eval_every=0",
        *(kv.format(ranks=args.ranks, nodes=args.nodes) for kv in parallel.LAYOUTS[args.layout]),
        *args.overrides,
    ]
    args.data = data_folder(args, overrides)
    overrides.append(f"data.path={args.data}")
    cfg = load_config(args.config, overrides)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    # One tracking store for every run of the invocation, made before the first, as a user's runs share the one
    # beside their run directories: each run pays opening it, none its creation (alembic's migrations, once).
    overrides.append(f"tracking.uri={work / 'mlflow.db'}")
    target = resolve(load_config(args.config, overrides).tracking, RunDir(work / "run"), {})
    if target is not None:
        create_store(target)
    if "trainer-recipe" in VARIANTS:
        args.recipe_config = write_user_recipe(args, overrides, work / "user-project")
    if "trainer-auto-flat" in VARIANTS:
        args.flat_plan = write_flat_plan(args, cfg, work / "flat_plan.json")
    args.nanogpt_folders = {}
    for variant in set(NANO) & set(VARIANTS):
        try:
            world, fused = args.nodes * args.ranks, variant == "nanogpt-fused"
            args.nanogpt_folders[variant] = nanogpt.prepare(
                args.nanogpt, work / variant, args.data, cfg, world, fused_cpu=fused
            )
        except nanogpt.NanoGPTError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        if args.link_mbit:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the namespaces are removed on TERM too
            with emulated_link(args.link_mbit) as args.namespaces:
                runs = run_rounds(args, overrides, work)
        else:
            runs = run_rounds(args, overrides, work)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)

    summary = summarize(runs, tokens_per_step)
    print_table(args, cfg, runs, summary)
    n_params = {v: runs[v][0]["n_params"] for v in VARIANTS if runs[v][0]["n_params"] is not None}
    if len(set(n_params.values())) > 1:
        print(f"\nwarning: the variants' models differ in parameter count ({n_params}): not the same work")
    elif n_params:
        count = next(iter(n_params.values()))
        print(f"\nparameters: {count:,} in every variant that reports them ({', '.join(n_params)})")
    disturbed = [f"{v} round {r['round'] + 1}" for v in VARIANTS for r in runs[v] if r["other_load"] > OTHER_LOAD_LIMIT]
    if disturbed:
        print(
            f"\nwarning: other processes used more than {OTHER_LOAD_LIMIT} cores during {', '.join(disturbed)}: "
            "those figures are disturbed; rerun on a quiet machine."
        )
    result = {
        "benchmark": "overhead",
        "setup": {
            "config": args.config,
            "layout": args.layout,
            "overrides": overrides,
            "nodes": args.nodes,
            "ranks_per_node": args.ranks,
            "threads_per_rank": args.threads,
            "steps": args.steps,
            "skip": args.skip,
            "rounds": args.rounds,
            "tokens_per_step": tokens_per_step,
            "data": str(args.data),
            "link_mbit": args.link_mbit,
            "target_ratio": TARGET,
        },
        "disturbed_runs": disturbed,
        "n_params": n_params,
        "summary": summary,
        "runs": {
            v: [{k: r[k] for k in ("round", "wall_s", "other_load", "median_step_s", RUN_CPU)} for r in runs[v]]
            for v in VARIANTS
        },
        "wall_s": time.perf_counter() - started,
    }
    text = json.dumps(result, indent=2)
    print("\n" + text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
