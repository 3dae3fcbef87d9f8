"""``python -m hpc sweep CONFIG GRID.yaml``: a grid of config overrides submitted as one Slurm job array.

GRID.yaml::

    grid:
      train.lr: [1.0e-3, 3.0e-3]
      model.d_model: [64, 128]

gives 4 elements (the cartesian product, in the order written), each with its own run directory
``SWEEP_DIR/NNN-lr=0.001_d_model=64`` holding its resolved config. All elements share the job shape (an array's
tasks all get the same allocation), so ``job.*`` keys cannot vary. Without Slurm the elements run one after the
other on this machine.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path

import yaml

from runconfig import ConfigError, RunConfig, RunDir, dump_yaml, from_dict, yamlread
from runconfig.contract import append_jsonl
from runconfig.load import load_raw, set_key
from runconfig.record import command_line, write_submission

SLUG_RE = re.compile(r"[^A-Za-z0-9._=-]+")


def read_grid(path: Path) -> dict[str, list]:
    try:
        data = yamlread.load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"sweep file {path} does not exist.") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"sweep file {path} is not UTF-8 text: the byte at offset {exc.start} is not valid UTF-8; save it as UTF-8."
        ) from None
    except OSError as exc:
        raise ConfigError(f"sweep file {path} cannot be read: {exc.strerror or exc}.") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"sweep file {path} is not valid YAML: {str(exc).splitlines()[0]}.") from None
    if not isinstance(data, dict) or set(data) != {"grid"} or not isinstance(data["grid"], dict) or not data["grid"]:
        raise ConfigError(f"sweep file {path} must hold one key, grid, mapping config keys to lists of values.")
    grid = data["grid"]
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep file {path}: grid key {key!r} needs a non-empty list of values.")
        if str(key).startswith("job."):
            raise ConfigError(
                f"sweep file {path}: grid key {key!r}: the job shape is shared by every element of a job array; "
                "submit separate runs to vary it."
            )
    return grid


def expand(config: str, grid_path: Path, overrides: list[str]) -> list[tuple[dict, RunConfig]]:
    """[(the element's overrides, its validated config)] for every point of the grid."""
    grid = read_grid(grid_path)
    base, _ = load_raw(config, overrides)
    out = []
    for i, combo in enumerate(itertools.product(*grid.values())):
        point = dict(zip(grid, combo, strict=True))
        raw = copy.deepcopy(base)
        for key, value in point.items():
            set_key(raw, key, value, what=f"sweep file {grid_path}: grid key {key!r}")
        out.append((point, from_dict(raw, source=f"{grid_path} element {i}")))
    return out


def element_name(index: int, point: dict) -> str:
    parts = "_".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in point.items())
    return f"{index:03d}-{SLUG_RE.sub('-', parts)}"[:120]


def create(sweep_dir: Path, elements: list[tuple[dict, RunConfig]]) -> list[RunDir]:
    if sweep_dir.exists() and any(sweep_dir.iterdir()):
        raise ConfigError(f"sweep directory {sweep_dir} already exists and is not empty; choose another --run-dir.")
    sweep_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(sweep_dir, 0o700)  # holds the submitit folder (pickles)
    dirs = []
    for i, (point, cfg) in enumerate(elements):
        rundir = RunDir(sweep_dir / element_name(i, point))
        rundir.create()
        rundir.config.write_text(dump_yaml(cfg))
        write_submission(rundir.record, command_line("hpc", sys.argv[1:]), resumed=False, project_source=None)
        dirs.append(rundir)
    return dirs


def record(sweep_dir: Path, elements: list[tuple[dict, RunConfig]], dirs: list[RunDir], ids: list[str]) -> None:
    rows = [
        {"run_dir": str(d.root), "overrides": point, "job_id": job_id}
        for (point, _), d, job_id in zip(elements, dirs, ids, strict=True)
    ]
    (sweep_dir / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    for d, job_id in zip(dirs, ids, strict=True):
        if job_id:
            append_jsonl(d.jobs, {"job_id": job_id, "array": True, "time": time.time()})
