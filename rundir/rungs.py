"""ASHA's rule at a rung, over the sweep's rung file (torch-free: the trainer's rank 0 reports, hpc reads).

Each element reports ``{"run", "step", "value", "time"}`` to the rung file (JSON lines, appended under an flock, so
that elements on several nodes see each other's reports in one order). At a rung with n reports (this one
included), an element continues when fewer than eta elements have reported there (nobody to be judged against
yet), else when it is among the best floor(n / eta); otherwise it is pruned. Asynchronous successive halving (Li et
al., "A System for Massively Parallel Hyperparameter Tuning", 2020): nobody waits for the rest of a rung, so a job
array's slots are never idle; an element reaching a rung early is judged against fewer peers.
"""

from __future__ import annotations

import fcntl
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from runconfig.schema.prune import PruneConfig
from rundir.paths import RunDir

RUNGS_NAME = "rungs.jsonl"


@dataclass(frozen=True)
class Verdict:
    prune: bool
    step: int
    value: float
    rank: int  # 0 = the best at this rung so far
    reports: int  # how many elements reported at this rung (this one included)
    keep: int  # how many of them continue

    def describe(self, metric: str) -> str:
        where = f"{metric}={self.value:.6g} at step {self.step}: {self.rank + 1} of {self.reports} at this rung"
        return f"{where}, the best {self.keep} continue" if self.keep < self.reports else f"{where}, all continue"


def rungs_path(cfg: PruneConfig, rundir: RunDir) -> Path:
    return Path(cfg.rungs) if cfg.rungs else rundir.root.parent / RUNGS_NAME


def judge(values: list[float], mine: float, eta: float, mode: str) -> tuple[bool, int, int]:
    """(pruned, this one's rank, how many continue) among ``values`` (this one's included)."""
    better = sorted(values, reverse=mode == "max")
    rank = better.index(mine)
    if len(values) < eta:
        return False, rank, len(values)
    keep = max(1, math.floor(len(values) / eta))
    return rank >= keep, rank, keep


def report(path: Path, run: str, step: int, value: float, cfg: PruneConfig) -> Verdict:
    """Record this element's value at the rung ``step`` (a relaunched element that reported there before keeps its
    first report) and judge it against every report at that step so far. A value that is not finite (a diverged
    element) is pruned and recorded as null, which no verdict counts."""
    finite = math.isfinite(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        at_step: dict[str, float] = {}
        for line in f.read().splitlines():
            try:
                r = json.loads(line)
                if r["step"] == step and isinstance(r["value"], (int, float)) and math.isfinite(r["value"]):
                    at_step.setdefault(r["run"], float(r["value"]))
            except (ValueError, KeyError, TypeError):
                continue  # a torn line of a killed writer
        if run not in at_step:
            shown = float(value) if finite else None
            f.write(json.dumps({"run": run, "step": step, "value": shown, "time": time.time()}) + "\n")
            f.flush()
            if not finite:
                return Verdict(True, step, value, len(at_step), len(at_step) + 1, len(at_step))
            at_step[run] = float(value)
    mine = at_step[run]
    pruned, rank, keep = judge(list(at_step.values()), mine, cfg.eta, cfg.mode)
    return Verdict(pruned, step, mine, rank, len(at_step), keep)
