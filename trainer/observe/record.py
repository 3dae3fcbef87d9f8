"""What a launch ran on, for RUN_DIR/record/launch-NNN.json (rundir/record.py): the software (Python, torch,
CUDA, NCCL, the MPI library, every installed distribution), each node with its ranks, CPU, memory and GPUs, and the
environment variables that change behaviour (the Slurm allocation's SLURM_* among them; credentials left out)."""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

from rundir.paths import RunDir
from rundir.record import next_number, recorded_environment, write_json
from trainer.parallel.mpi_library import library_name


def _first(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text(errors="replace").splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def host_facts(hostname: str, device: torch.device) -> dict:
    """This rank's view of its host: CPU model, cores it may use, memory, and its GPU with the driver."""
    facts = {
        "host": hostname,
        "cpu": _first("/proc/cpuinfo", "model name") or platform.processor() or None,
        "cpus_per_rank": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_kb": int((_first("/proc/meminfo", "MemTotal") or "0 kB").split()[0]),
        "kernel": platform.release(),
        "gpu": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        # "NVRM version: NVIDIA UNIX [Open] Kernel Module [for x86_64]  550.54.15  Release Build ...": the version
        found = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", _first("/proc/driver/nvidia/version", "NVRM version") or "")
        driver = found.group(1) if found else None
        facts["gpu"] = {"name": props.name, "memory_mb": props.total_memory >> 20,
                        "capability": f"{props.major}.{props.minor}", "driver": driver}  # fmt: skip
    return facts


def software() -> dict:
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):
            nccl = None
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": nccl,
        "mpi": library_name(MPI.Get_library_version()),
        "mpi_standard": ".".join(map(str, MPI.Get_version())),
    }


def packages() -> list[str]:
    """``pip freeze``'s content: NAME==VERSION of every distribution on the import path, from the names of their
    ``NAME-VERSION.dist-info`` (or ``.egg-info``) folders, the first one found per name as imports do. Listing the
    folders takes ~1 ms where reading every METADATA file (importlib.metadata) took ~110 ms of rank 0's start-up."""
    seen: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for folder in names:
            stem, dot, kind = folder.rpartition(".")
            name, _, version = stem.partition("-")
            if dot and kind in ("dist-info", "egg-info") and version:
                seen.setdefault(name.lower().replace("-", "_"), f"{name}=={version}")
    return sorted(seen.values(), key=str.lower)


def gather_launch_record(env, device: torch.device, comm: MPI.Comm) -> dict | None:
    """Every rank's host facts, on rank 0 (None elsewhere) with the rest of the launch's record. Collective."""
    mine = {"rank": env.rank, "node": env.node_names[env.rank], **host_facts(env.hostname, device)}
    facts = comm.gather(mine, root=0)
    if env.rank != 0:
        return None
    nodes: dict[str, dict] = {}
    for f in facts:
        rank, node = f.pop("rank"), f.pop("node")
        gpu = f.pop("gpu")
        entry = nodes.setdefault(node, {**f, "ranks": [], "gpus": []})
        entry["ranks"].append(rank)
        if gpu is not None:
            entry["gpus"].append({"rank": rank, **gpu})
    return {
        "time": time.time(),
        "launch": env.launch_id,
        "world_size": env.world_size,
        "software": software(),
        "packages": packages(),
        "nodes": nodes,
        "environment": recorded_environment(os.environ),
        "argv": sys.argv,
    }


def write_launch_record(rundir: RunDir, record: dict, step: int) -> Path:
    """Rank 0: record/launch-NNN.json, numbered in launch order (the launcher's id is inside)."""
    number = next_number(rundir.record, "launch")
    path = rundir.record / f"launch-{number:03d}.json"
    write_json(path, {**record, "step": step})
    return path
