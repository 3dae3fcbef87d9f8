"""``python -m hpc compare RUN RUN ...``: how runs differ, from a login node (torch-free).

Prints each run's row (hpc/runs.py) and the config keys whose values differ between the runs (the resolved
config.yaml of each, flattened to dotted keys), and writes one PNG with their loss curves overlaid (train loss as
lines, eval loss as markers, by step): ``--out FILE`` (default ``compare.png`` in the current folder).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from hpc.plots import DPI, _finish, _series
from hpc.runlog import RunLog, analyze
from hpc.runs import RunsError, rows, table
from runconfig.load import flatten
from rundir import RunDir

MISSING = "(not set)"


def differences(rundirs: list[RunDir]) -> dict[str, list[object]]:
    """Dotted key -> each run's value, for the keys whose values are not all the same."""
    flat = [flatten(yaml.safe_load(d.config.read_text()) or {}) for d in rundirs]
    keys = sorted(set().union(*flat))
    out = {}
    for key in keys:
        values = [f.get(key, MISSING) for f in flat]
        if any(json.dumps(v, sort_keys=True, default=str) != json.dumps(values[0], sort_keys=True, default=str)
               for v in values[1:]):  # fmt: skip
            out[key] = values
    return out


def labels(rundirs: list[RunDir]) -> list[str]:
    """Each run's folder name, with its parent's where two runs share a name."""
    names = [d.root.name for d in rundirs]
    return [f"{d.root.parent.name}/{n}" if names.count(n) > 1 else n for d, n in zip(rundirs, names, strict=True)]


def plot(names: list[str], logs: list[RunLog], out: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5), layout="constrained")
    ax = fig.subplots()
    for i, (name, log) in enumerate(zip(names, logs, strict=True)):
        color = f"C{i % 10}"
        ax.plot(*_series(log.kept, "loss"), color=color, linewidth=1.2, label=f"{name} (train)")
        ev = _series(log.kept, "eval_loss")
        if ev[0]:
            ax.plot(*ev, color=color, marker="o", markersize=4, linestyle="none", label=f"{name} (eval)")
    _finish(ax, "step", "loss", "loss by step", legend="upper right")
    FigureCanvasAgg(fig)
    fig.savefig(out, dpi=DPI)
    return out


def main(paths: list[str], *, out: str | None) -> int:
    rundirs = []
    for p in paths:
        if not (Path(p) / "config.yaml").is_file():
            raise RunsError(f"{p} is not a run directory (it has no config.yaml).")
        rundirs.append(RunDir(Path(p)))
    if len(rundirs) < 2:
        raise RunsError("compare needs at least two run directories.")
    names, logs = labels(rundirs), [analyze(d) for d in rundirs]
    print(table([{**r, "name": n} for r, n in zip(rows(rundirs, logs), names, strict=True)]))
    diff = differences(rundirs)
    print(f"\nconfig keys that differ ({len(diff)}):" if diff else "\nthe configs are the same")
    if diff:
        print("| key | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        for key, values in diff.items():
            print(f"| {key} | " + " | ".join(json.dumps(v, default=str) if v != MISSING else v for v in values) + " |")
    png = plot(names, logs, Path(out or "compare.png"))
    print(f"\nloss curves: {png}")
    return 0
