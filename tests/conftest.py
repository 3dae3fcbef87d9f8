"""Shared fixtures: a small real dataset prepared once, an isolated data cache, and an mpirun helper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runconfig.contract import DATA_CACHE_VAR

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def mpirun_path() -> str:
    here = Path(PY).parent / "mpirun"
    return str(here) if here.exists() else "mpirun"


def run_mpi(n: int, args: list[str], *, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on n ranks under the pip-installed MPI; nodes simulated via ``env``."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p)
    full_env.update(env or {})
    return subprocess.run(
        [mpirun_path(), "-n", str(n), PY, "-u", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
    )


def rank_results(folder: Path) -> list[dict]:
    """The per-rank JSON files a worker script wrote (rank_N.json), in rank order."""
    files = sorted(folder.glob("rank_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(f.read_text()) for f in files]


def summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def history(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "history.jsonl").read_text().splitlines()]


def run_cli(args: list[str], *, timeout: float = 600, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([PY, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


@pytest.fixture(scope="session", autouse=True)
def isolated_data_cache(tmp_path_factory):
    """Datasets prepared on first use go to a per-session folder, not the user's ~/.cache."""
    old = os.environ.get(DATA_CACHE_VAR)
    os.environ[DATA_CACHE_VAR] = str(tmp_path_factory.mktemp("data-cache"))
    yield Path(os.environ[DATA_CACHE_VAR])
    if old is None:
        os.environ.pop(DATA_CACHE_VAR, None)
    else:
        os.environ[DATA_CACHE_VAR] = old


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> Path:
    """About 2 MB of real text (the standard library's sources) prepared into several shards."""
    from trainer.data.prepare import PrepareSpec, prepare

    out = tmp_path_factory.mktemp("small") / "data"
    spec = PrepareSpec(
        source="stdlib", include=("*.py",), max_source_bytes=2_000_000, val_fraction=0.1, shard_tokens=400_000
    )
    prepare(spec, out)
    return out
