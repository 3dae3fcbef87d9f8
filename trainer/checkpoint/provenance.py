"""Where a run's code and libraries came from, and the rest of what a checkpoint manifest records about the run."""

from __future__ import annotations

import functools
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from runconfig.load import config_hash


@functools.cache
def git_commit() -> str | None:
    """The commit of the checkout the trainer runs from, if it is one (dirty trees get a '+dirty' suffix)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


@functools.cache
def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "mpi4py", "h5py", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def manifest_fields(*, cfg, env, state, identity: dict, code_sha256: str | None, optimizer_type: str, fmt: int) -> dict:
    """What a generation's manifest records besides its files: the step and loop state, the world and topology,
    the config's hash, what identifies the model and optimizer, the code, libraries and Slurm ids."""
    return {
        "format": fmt,
        "step": state.step,
        "tokens_seen": state.tokens_seen,
        "data_position": state.data_position,
        "loss": state.last_loss,
        "eval": state.last_eval,  # the latest evaluation, at or before this step (checkpoint.keep_best)
        "world_size": env.world_size,
        "topology": env.topology.describe(),
        "config_sha256": config_hash(cfg),
        **identity,
        "recipe_args": cfg.recipe_args,
        "code_sha256": code_sha256,
        "optimizer": {"type": optimizer_type},
        "git_commit": git_commit(),
        "versions": versions(),
        "slurm_job_id": env.slurm_job_id,
        "slurm_restart_count": env.slurm_restart_count,
        "wall_time_s": state.elapsed_s,
    }
