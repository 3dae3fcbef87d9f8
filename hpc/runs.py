"""``python -m hpc runs [DIR ...]``: the runs under some folders, one row each, to compare from a login node.

A DIR that is a run directory (it has config.yaml) is one run; any other folder is searched for run directories
below it (a runs folder, a sweep). Each row: name, state, steps done of the configured ones, the last loss and eval
loss, the median tokens/s (units/s) of the kept records, goodput, restarts and wall time, from the files only
(hpc/status.py, hpc/runlog.py's accounting), then the time queued, node- and GPU-hours, the cost and the cost per
million tokens (hpc/cost.py: Slurm accounting where it has the run's jobs; the price from each run's cost section).
``--sort KEY`` (``--desc`` or ``--sort=-KEY`` descending), ``--filter KEY<OP>VALUE`` (``= != < <= > >=``; several
filters must all hold), ``--json``.
"""

from __future__ import annotations

import json
import math
import operator
import re
import statistics
from pathlib import Path

from hpc.cost import Cost, costs
from hpc.jobs import states_of
from hpc.runlog import RunLog, analyze
from hpc.slurmctl import JobState
from hpc.status import VerbError, status
from rundir import RunDir

COLUMNS = (
    "name",
    "state",
    "step",
    "steps",
    "loss",
    "eval_loss",
    "tokens_per_s",
    "goodput",
    "restarts",
    "wall_s",
    "queued_s",
    "node_hours",
    "gpu_hours",
    "cost",
    "cost_per_m",
)
OPS = {"<=": operator.le, ">=": operator.ge, "!=": operator.ne, "=": operator.eq, "<": operator.lt, ">": operator.gt}
FILTER_RE = re.compile(r"^\s*([a-z_]+)\s*(<=|>=|!=|=|<|>)\s*(.*?)\s*$")


class RunsError(VerbError):
    pass


def find_runs(folders: list[Path]) -> list[RunDir]:
    out, seen = [], set()
    for folder in folders:
        if not folder.is_dir():
            raise RunsError(f"{folder} is not a folder.")
        if (folder / "config.yaml").is_file():
            found = [folder]
        else:  # a run directory's own folders (its code snapshot, a user's config in it) are not runs
            found = sorted(p.parent for p in folder.rglob("config.yaml") if (p.parent / "history.jsonl").is_file())
        for path in found:
            if path.resolve() not in seen and not any(q in seen for q in path.resolve().parents):
                seen.add(path.resolve())
                out.append(RunDir(path))
    return out


def rows(rundirs: list[RunDir], logs: list[RunLog] | None = None) -> list[dict]:
    """``row`` of each run, their Slurm jobs' states and accounting asked for in one batch each."""
    logs = logs or [analyze(d) for d in rundirs]
    priced = costs(rundirs, logs)
    return [
        row(d, log, jobs, cost) for d, log, jobs, cost in zip(rundirs, logs, states_of(rundirs), priced, strict=True)
    ]


def row(
    rundir: RunDir, log: RunLog | None = None, jobs: list[JobState] | None = None, cost: Cost | None = None
) -> dict:
    """``log``: the run's analysis where the caller has it already; ``jobs``: its job states, likewise; ``cost``:
    what it cost, likewise."""
    info = status(rundir, jobs)
    log = log or analyze(rundir)
    cost = cost or costs([rundir], [log])[0]
    kept = [s.raw for s in log.kept]
    evals = [r["eval_loss"] for r in kept if isinstance(r.get("eval_loss"), (int, float))]
    speeds = [r["tokens_per_s"] for r in kept[1:] if isinstance(r.get("tokens_per_s"), (int, float))]
    return {
        "name": rundir.root.name,
        "run_dir": str(rundir.root),
        "state": info["state"],
        "step": info["step"],
        "steps": info["steps"],
        "loss": info["loss"],
        "eval_loss": evals[-1] if evals else None,
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "goodput": log.accounting.goodput,
        "restarts": log.restarts,
        "wall_s": log.accounting.total_wall_s,
        "queued_s": cost.usage.queued_s,
        "node_hours": cost.usage.node_hours,
        "gpu_hours": cost.usage.gpu_hours,
        "cost": cost.total,
        "cost_per_m": cost.per_million,
        "currency": cost.prices.currency,
        "cost_source": cost.usage.source,
    }


def parse_filter(text: str) -> tuple[str, str, str]:
    m = FILTER_RE.match(text)
    if not m or m.group(1) not in COLUMNS:
        raise RunsError(
            f"--filter {text!r}: write KEY<OP>VALUE with KEY one of {', '.join(COLUMNS)} and OP one of "
            f"{' '.join(OPS)} (e.g. --filter 'state=completed' --filter 'loss<2.5')."
        )
    return m.group(1), m.group(2), m.group(3)


def _typed(value: str, like: object) -> object:
    if isinstance(like, (int, float)) and not isinstance(like, bool):
        try:
            return float(value)
        except ValueError:
            raise RunsError(f"--filter: {value!r} is not a number") from None
    return value


def keep(r: dict, filters: list[tuple[str, str, str]]) -> bool:
    for key, op, value in filters:
        have = r.get(key)
        if have is None:
            return False
        if not OPS[op](have, _typed(value, have)):
            return False
    return True


def sort_rows(rows: list[dict], key: str | None) -> list[dict]:
    if not key:
        return rows
    name, descending = key.lstrip("-"), key.startswith("-")
    if name not in COLUMNS:
        raise RunsError(f"--sort {key!r}: sort by one of {', '.join(COLUMNS)} (a leading - sorts descending).")
    if not any(r.get(name) is not None for r in rows):
        raise RunsError(f"--sort {name}: no run has a {name} yet.")
    present = sorted((r for r in rows if r.get(name) is not None), key=lambda r: r[name], reverse=descending)
    return present + [r for r in rows if r.get(name) is None]  # the runs without it last, either way


def _cell(key: str, value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if key == "goodput":
        return f"{value:.1%}"
    if key in ("node_hours", "gpu_hours"):
        return f"{value:.3g}"
    if key in ("cost", "cost_per_m"):
        return f"{value:,.2f}" if value >= 1 else f"{value:.3g}"
    if key in ("wall_s", "queued_s"):
        return f"{value / 60:.1f} min" if value >= 60 else f"{value:.0f} s"
    if key in ("loss", "eval_loss"):
        return f"{value:.4f}"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    return str(value)


def _priced(key: str, cell: str, r: dict) -> str:
    return f"{cell} {r.get('currency', '')}".rstrip() if key in ("cost", "cost_per_m") and cell != "-" else cell


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [_cell(k, r.get(k)) for k in COLUMNS]
        lines.append("| " + " | ".join(_priced(k, c, r) for k, c in zip(COLUMNS, cells, strict=True)) + " |")
    return "\n".join(lines)


def main(folders: list[str], *, sort: str | None, filters: list[str], as_json: bool) -> int:
    parsed = [parse_filter(f) for f in filters]
    rundirs = find_runs([Path(f) for f in folders or ["runs"]])
    if not rundirs:
        raise RunsError(f"no run directories (folders with a config.yaml) under {', '.join(folders or ['runs'])}.")
    found = sort_rows([r for r in rows(rundirs) if keep(r, parsed)], sort)
    print(json.dumps(found, indent=1) if as_json else table(found))
    return 0
