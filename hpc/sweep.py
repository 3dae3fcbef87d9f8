"""A sweep's data (torch-free): SWEEP.yaml's grid or random search expanded into elements (config overrides), their
run directories, sweep.json, and the results table (every element's `hpc runs` row, best first by the sweep's
metric), rewritten as each element ends. Submitting it: hpc/sweep_submit.py; the sweep file and its pruning
(ASHA) keys: docs/slurm.md."""

from __future__ import annotations

import copy
import fcntl
import itertools
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hpc.runs import rows as run_rows
from hpc.sweeptrack import finish_parent
from runconfig import ConfigError, RunConfig, dump_yaml, from_dict, yamlread
from runconfig.load import load_raw, set_key
from rundir import RunDir
from rundir.paths import read_jsonl
from rundir.record import command_line, write_submission
from storage.files import append_jsonl, write_atomic, write_json_atomic

SLUG_RE = re.compile(r"[^A-Za-z0-9._=-]+")


SPEC_KEYS = {"grid", "random", "metric", "mode", "prune"}
PRUNE_KEYS = {"at_steps", "eta"}
TABLE_METRICS = ("loss", "eval_loss", "tokens_per_s", "goodput", "wall_s", "restarts", "step")
FORMS = ("log", "uniform", "int")


@dataclass(frozen=True)
class SweepSpec:
    """A sweep file, checked: each element's overrides, and how the elements are ranked and pruned."""

    path: Path
    points: list[dict]
    kind: str  # "grid" or "random"
    metric: str = "eval_loss"
    mode: str = "min"
    prune: dict = field(default_factory=dict)  # {"at_steps": [...], "eta": x}, empty: no pruning
    seed: int | None = None

    def summary(self) -> dict:
        return {"kind": self.kind, "elements": len(self.points), "metric": self.metric, "mode": self.mode,
                "prune": self.prune, "seed": self.seed, "file": str(self.path)}  # fmt: skip


def _load(path: Path) -> object:
    try:
        return yamlread.load(Path(path).read_text(encoding="utf-8"))
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


def _no_job_key(path: Path, key: object, where: str) -> None:
    if str(key).startswith("job."):
        raise ConfigError(
            f"sweep file {path}: {where} key {key!r}: the job shape is shared by every element of a job array; "
            "submit separate runs to vary it."
        )


def read_grid(path: Path) -> dict[str, list]:
    """The grid of a sweep file that has one (read_spec checks the rest)."""
    data = _load(path)
    if not isinstance(data, dict) or not isinstance(data.get("grid"), dict) or not data["grid"]:
        raise ConfigError(f"sweep file {path} must hold grid, mapping config keys to lists of values (or random).")
    grid = data["grid"]
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep file {path}: grid key {key!r} needs a non-empty list of values.")
        _no_job_key(path, key, "grid")
    return grid


def read_random(path: Path, spec: object) -> tuple[list[dict], int]:
    """The points of a ``random`` section: n draws of every key's distribution, from the seed."""
    if not isinstance(spec, dict):
        raise ConfigError(f"sweep file {path}: random must map n, seed and config keys to distributions.")
    n, seed = spec.get("n"), spec.get("seed", 0)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"sweep file {path}: random.n must be a whole number >= 1 (how many elements), got {n!r}.")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"sweep file {path}: random.seed must be a whole number, got {seed!r}.")
    space = {k: v for k, v in spec.items() if k not in ("n", "seed")}
    if not space:
        raise ConfigError(f"sweep file {path}: random needs at least one config key to draw, e.g. train.lr: {{log: "
                          "[1.0e-4, 1.0e-2]}.")  # fmt: skip
    for key, dist in space.items():
        _no_job_key(path, key, "random")
        _check_distribution(path, key, dist)
    rng = random.Random(seed)
    return [{key: _draw(rng, dist) for key, dist in space.items()} for _ in range(n)], seed


def _check_distribution(path: Path, key: str, dist: object) -> None:
    where = f"sweep file {path}: random key {key!r}"
    if isinstance(dist, list):
        if not dist:
            raise ConfigError(f"{where}: an empty list of choices.")
        return
    if not isinstance(dist, dict) or len(dist) != 1 or next(iter(dist)) not in FORMS:
        raise ConfigError(f"{where}: write a list of choices or one of {{log: [a, b]}}, {{uniform: [a, b]}}, "
                          f"{{int: [a, b]}}; got {dist!r}.")  # fmt: skip
    form, bounds = next(iter(dist.items()))
    numbers = isinstance(bounds, list) and len(bounds) == 2
    if not numbers or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds):
        raise ConfigError(f"{where}: {form} needs [low, high], two numbers; got {bounds!r}.")
    low, high = bounds
    if not all(math.isfinite(b) for b in bounds):
        raise ConfigError(f"{where}: {form} needs finite bounds, got {bounds!r}.")
    if form == "int" and not all(isinstance(b, int) for b in bounds):
        raise ConfigError(f"{where}: int needs whole-number bounds, got {bounds!r}.")
    if (form == "int" and low > high) or (form != "int" and low >= high):
        what = "inverted" if low > high else "empty"
        raise ConfigError(f"{where}: the range [{low}, {high}] is {what}: write [low, high] with low < high.")
    if form == "log" and low <= 0:
        raise ConfigError(f"{where}: log needs bounds above 0, got [{low}, {high}].")


def _draw(rng: random.Random, dist: list | dict) -> object:
    if isinstance(dist, list):
        return copy.deepcopy(rng.choice(dist))
    form, (low, high) = next(iter(dist.items()))
    if form == "int":
        return rng.randint(low, high)
    value = math.exp(rng.uniform(math.log(low), math.log(high))) if form == "log" else rng.uniform(low, high)
    # 4 significant digits: readable names, values a person can type again; kept inside the range
    return min(max(float(f"{value:.4g}"), low), high)


def read_spec(path: Path) -> SweepSpec:
    data = _load(path)
    if not isinstance(data, dict) or ("grid" in data) == ("random" in data) or set(data) - SPEC_KEYS:
        raise ConfigError(
            f"sweep file {path} must hold one of grid (config keys to lists of values) or random (n, seed and "
            f"config keys to distributions), and optionally metric, mode and prune; it holds "
            f"{', '.join(map(str, data)) if isinstance(data, dict) else type(data).__name__}."
        )
    metric, mode = data.get("metric", "eval_loss"), data.get("mode", "min")
    if not isinstance(metric, str) or not metric.strip():
        raise ConfigError(f"sweep file {path}: metric must name a metric, e.g. eval_loss; got {metric!r}.")
    if mode not in ("min", "max"):
        raise ConfigError(f"sweep file {path}: mode must be min or max, got {mode!r}.")
    prune = data.get("prune") or {}
    if prune and (not isinstance(prune, dict) or set(prune) - PRUNE_KEYS or "at_steps" not in prune):
        raise ConfigError(f"sweep file {path}: prune takes at_steps (rung steps) and eta, e.g. prune: {{at_steps: "
                          "[100, 200], eta: 3}.")  # fmt: skip
    if not prune and metric not in TABLE_METRICS:
        raise ConfigError(f"sweep file {path}: metric {metric!r}: the results table ranks by one of "
                          f"{', '.join(TABLE_METRICS)} (prune can judge any metrics.jsonl key).")  # fmt: skip
    if "grid" in data:
        grid = read_grid(path)
        points = [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())]
        return SweepSpec(path, points, "grid", metric, mode, prune)
    points, seed = read_random(path, data["random"])
    return SweepSpec(path, points, "random", metric, mode, prune, seed)


def expand(config: str, sweep_path: Path, overrides: list[str], sweep_dir: Path | None = None):
    """(the spec, [(the element's overrides, its validated config)]); prune's keys go into every element's config,
    with its rung file in ``sweep_dir``."""
    spec = read_spec(sweep_path)
    base, _ = load_raw(config, overrides)
    out = []
    for i, point in enumerate(spec.points):
        raw = copy.deepcopy(base)
        for key, value in point.items():
            set_key(raw, key, value, what=f"sweep file {sweep_path}: key {key!r}")
        if spec.prune:
            what = f"sweep file {sweep_path}: prune"
            set_key(raw, "prune.metric", spec.metric, what=what)
            set_key(raw, "prune.mode", spec.mode, what=what)
            set_key(raw, "prune.at_steps", spec.prune["at_steps"], what=what)
            if "eta" in spec.prune:
                set_key(raw, "prune.eta", spec.prune["eta"], what=what)
            if sweep_dir is not None:
                set_key(raw, "prune.rungs", str(sweep_dir / "rungs.jsonl"), what=what)
        storage = (raw.get("checkpoint") or {}).get("storage")
        if storage:  # a prefix belongs to one run (trainer/checkpoint/remote.py): each element gets its own
            prefix = f"{str(storage).rstrip('/')}/{element_name(i, point)}"
            set_key(raw, "checkpoint.storage", prefix, what=f"sweep file {sweep_path}: element {i}")
        out.append((point, from_dict(raw, source=f"{sweep_path} element {i}")))
    return spec, out


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
        write_atomic(rundir.config, dump_yaml(cfg), fsync=True)
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


SPEC_FILE, RESULTS_MD, RESULTS_JSON, LOCK = "sweep_spec.json", "results.md", "results.json", ".results.lock"
FINAL = ("completed", "pruned", "failed", "stopped")  # an element's states once its job has ended


def write_spec(sweep_dir: Path, spec: SweepSpec) -> None:
    (sweep_dir / SPEC_FILE).write_text(json.dumps(spec.summary(), indent=1) + "\n")


def _last_value(rundir: RunDir, key: str) -> float | None:
    values = [r[key] for r in read_jsonl(rundir.metrics) if isinstance(r.get(key), (int, float))]
    return values[-1] if values else None


def results(sweep_dir: Path, own: tuple[str, str | None] = ("", None)) -> tuple[list[dict], str]:
    """Every element's `hpc runs` row with its overrides, best first by the sweep's metric (elements without it
    last), and the markdown table of them. ``own``: (an element's name, its state) said by its launcher, whose job
    Slurm still shows running while it ends."""
    spec = json.loads((sweep_dir / SPEC_FILE).read_text()) if (sweep_dir / SPEC_FILE).exists() else {}
    metric, mode = spec.get("metric", "eval_loss"), spec.get("mode", "min")
    entries = json.loads((sweep_dir / "sweep.json").read_text())
    rundirs = [RunDir(Path(entry["run_dir"])) for entry in entries]
    rows = []
    for entry, rundir, element in zip(entries, rundirs, run_rows(rundirs), strict=True):
        r = {**element, "overrides": entry["overrides"]}
        if rundir.root.name == own[0] and own[1] and r["state"] not in FINAL:
            r["state"] = own[1]
        if metric not in r:
            r[metric] = _last_value(rundir, metric)
        rows.append(r)
    have = sorted((r for r in rows if r.get(metric) is not None), key=lambda r: r[metric], reverse=mode == "max")
    rows = have + [r for r in rows if r.get(metric) is None]
    keys = list(dict.fromkeys(k for r in rows for k in r["overrides"]))
    header = ["rank", "name", "state", metric, *keys, "step", "wall_s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, r in enumerate(rows, 1):
        value = r.get(metric)
        cells = [str(i), r["name"], r["state"], "-" if value is None else f"{value:.6g}"]
        cells += [str(r["overrides"].get(k, "-")) for k in keys]
        cells += [f"{r['step']}/{r['steps']}", "-" if r["wall_s"] is None else f"{r['wall_s']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    title = f"sweep {sweep_dir.name}: {len(rows)} elements, best first by {metric} ({mode})"
    return rows, title + "\n\n" + "\n".join(lines)


def element_ended(rundir: RunDir, state: str | None = None) -> str | None:
    """After an element's launcher is done with it: rewrite the sweep's results (under a lock: elements end on
    several nodes at once); once every element has ended, the table (to print) and the parent tracker run is
    finished with it. None for a run that is no sweep's element, or while others still run."""
    sweep_dir = rundir.root.parent
    if not (sweep_dir / "sweep.json").is_file():
        return None
    with open(sweep_dir / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows, text = results(sweep_dir, own=(rundir.root.name, state))
        write_atomic(sweep_dir / RESULTS_MD, text + "\n", fsync=False)
        write_json_atomic(sweep_dir / RESULTS_JSON, rows, fsync=False, indent=1, default=str)
        if not all(r["state"] in FINAL for r in rows):
            return None
        note = finish_parent(sweep_dir, rows)
    return text + (f"\n{note}" if note else "")
