"""bench/overhead.py's variants: which exist, which run for a layout and a topology, and the command line of each
(bench/README.md describes every variant)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import nanogpt  # bench/nanogpt.py (bench/ on sys.path)
import yaml
from common import LINK_IPS, ROOT

from runconfig import RunConfig, load_config
from runconfig.load import load_raw

ALL_VARIANTS = (
    "plain", "trainer-flat", "trainer-hier", "trainer-hier-sync", "trainer-hier-pipe", "trainer-hier-bf16",
    "trainer-quiet", "trainer-recipe", "trainer-agree-sync", "trainer-agree-separate", "trainer-auto",
    "trainer-auto-flat", "trainer-leader", "trainer-auto-small", "trainer-optim-loop", "trainer-replicas",
    "trainer-untracked", "trainer-nodims", "nanogpt", "nanogpt-fused",
)  # fmt: skip
NANO = ("nanogpt", "nanogpt-fused")
# The variants whose all-reduce is not flat: they differ from trainer-flat only with 2+ nodes of 2+ ranks.
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
AUTO = ("trainer-auto", "trainer-auto-flat", "trainer-auto-small")
# trainer-quiet: flat all-reduce with TensorBoard, straggler checks and the hang watchdog off (the step clock stays):
# the cost of the monitors, side by side.
QUIET = ["monitor.tensorboard=false", "monitor.straggler_every=0", "monitor.hang_timeout_s=0"]
# Each variant's settings on top of its all-reduce (trainer-auto-flat's plan file is added in command()).
EXTRA_SETS = {
    "trainer-quiet": QUIET,
    "trainer-hier-sync": ["comm.overlap=false"],
    "trainer-hier-bf16": ["comm.compress=bf16"],
    "trainer-hier-pipe": ["comm.chunk_kb=1024"],
    "trainer-agree-separate": ["comm.carry_agreement=false"],
    "trainer-agree-sync": ["comm.carry_agreement=false", "comm.defer_agreement=false"],
    "trainer-auto-small": ["comm.bucket_mb=0.25"],
    # AdamW's per-parameter loop (nanoGPT's path on CPU) instead of the fused kernels of the default
    "trainer-optim-loop": ["train.optimizer_impl=for-loop"],
    "trainer-replicas": ["monitor.replica_check_every=1"],
    "trainer-untracked": ["tracking.backend=off"],
    "trainer-nodims": ["monitor.comm_by_dim=false"],
}
# trainer-recipe: the user-style recipe module (copied next to the config the benchmark writes) and its function.
USER_RECIPE = ROOT / "bench" / "recipes" / "user_gpt.py"
USER_RECIPE_SPEC = "user_gpt:recipe"
# Outside DDP (--layout): the plain peer, the trainer as configured, and the trainer with its monitors off.
LAYOUT_VARIANTS = ("plain", "trainer-flat", "trainer-quiet", "trainer-untracked", "trainer-nodims")
# bench/parallel.py's layouts that bench/plain_layouts.py has (the pp-* ones: its --layout pp, the schedule from
# the config)
PLAIN_LAYOUTS = ("fsdp", "hsdp", "tp-fsdp", "cp", "pp", "pp-interleaved", "pp-izb", "pp-zbv", "pp-dualpipev")
PLAIN_NAMES = {
    "ddp": "bench/plain_ddp.py",
    **{k: f"bench/plain_layouts.py --layout {k.split('-')[0] if k.startswith('pp') else k}" for k in PLAIN_LAYOUTS},
}
PLAIN_PROGRESS = "progress.txt"  # plain_ddp.py's live step count, beside its times.json


def chosen_variants(args: argparse.Namespace) -> tuple[str, ...]:
    """The variants this invocation runs, in ALL_VARIANTS' order: ``--variants`` (plain always), narrowed to those
    that mean something for the layout, nanoGPT's only with ``--nanogpt``, the non-flat ones only with 2+ nodes of
    2+ ranks (said so when some are left out)."""
    variants = tuple(v for v in ALL_VARIANTS if not args.variants or v in args.variants)
    if args.layout != "ddp":
        variants = tuple(v for v in variants if v in LAYOUT_VARIANTS)
    if not args.nanogpt:
        variants = tuple(v for v in variants if v not in NANO)
    if (args.nodes < 2 or args.ranks < 2) and set(HIER) & set(variants):
        variants = tuple(v for v in variants if v not in HIER)
        print(f"{args.nodes} node(s) x {args.ranks} ranks: no trainer-hier (the trainer falls back to flat all-reduce)")
    return variants


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
    """The command line of one run of ``variant``, its output at ``out`` (plain's JSON file, nanoGPT's launch log,
    the trainer's run directory)."""
    sets = [a for kv in overrides for a in ("--set", kv)]
    if variant == "plain":
        script = [sys.executable, str(ROOT / "bench" / "plain_ddp.py"), "--config", args.config]
        if args.layout != "ddp":
            layout = "pp" if args.layout.startswith("pp") else args.layout
            script = [sys.executable, str(ROOT / "bench" / "plain_layouts.py"), "--layout", layout]
            script += ["--config", args.config]
        progress = ["--progress", str(out.with_name(PLAIN_PROGRESS))]
        return torchrun_style(args, [*script, "--data", str(args.data), *sets, "--json", str(out), *progress])
    if variant in NANO:
        return torchrun_style(args, nanogpt.command(args.nanogpt_folders[variant], sys.executable))
    allreduce = {**dict.fromkeys(AUTO, "auto"), "trainer-leader": "leader"}.get(variant, "hierarchical")
    allreduce = allreduce if variant in HIER else "flat"
    config = args.config
    if variant == "trainer-recipe":  # the model's shape is in the written config's recipe_args
        config = str(args.recipe_config)
        sets = [a for kv in overrides if not kv.startswith("model.") for a in ("--set", kv)]
    submit = [sys.executable, "-m", "hpc.submit", config, "--local", "--run-dir", str(out)]
    extra = [*EXTRA_SETS.get(variant, [])]
    extra += [f"comm.plan_from={args.flat_plan}"] if variant == "trainer-auto-flat" else []
    extra += [f"comm.master_addr={LINK_IPS[0]}"] if args.namespaces else []
    return [*submit, *sets, "--set", f"comm.allreduce={allreduce}", *(a for kv in extra for a in ("--set", kv))]
