"""What a run cost (torch-free): node-hours, GPU-hours and the time queued of its allocations, their price, and its
goodput split the way Google's ML-productivity goodput is (scheduling x runtime x program).

Where the run's jobs are in Slurm's accounting, the allocations are sacct's (every run of each job, requeues
included: what the cluster charges, the job's own set-up around the trainer included); otherwise (no Slurm, no
accounting, a job accounting has no record of) the launches' wall time x their nodes and GPUs, from history.jsonl.
The definitions are DEFINITIONS below, which report.md repeats.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from itertools import pairwise

from hpc import slurmctl
from hpc.jobs import job_ids
from hpc.runlog import RunLog, config_dict, number
from rundir import RunDir
from rundir.contract import EVENT_HANG

DEFINITIONS = """\
- **Node-hours, GPU-hours**: with Slurm accounting, each run of each of the run's jobs (sacct: requeues
  included) counts its elapsed time x its allocated nodes (AllocNodes) and GPUs (`gres/gpu` of AllocTRES);
  otherwise each launch's wall time x the nodes it ran on and, on GPUs, its ranks (one GPU each).
- **Queued**: with accounting, each run's start minus when it could start (its submission; for a chain's link,
  its dependency met, sacct's Eligible; for a requeued run, the end of the job's run before), a job still pending
  that could start counted until now; otherwise the time from the first submission to the first launch plus the
  gaps before another job or run of a job (a requeue, a chain's next link). A gap before a restart in the same
  allocation after a failure counts as time held instead; a local run stopped and resumed later is neither.
- **Cost** = node-hours x `cost.node_hour`, or GPU-hours x `cost.gpu_hour`; **per million tokens** = cost /
  (tokens seen, in the recipe's units, / 10^6): the tokens of the trained model, the recomputed ones not counted
  twice.
- **Goodput split** (Google's ML-productivity goodput): **scheduling** = time held / (time held + queued);
  **runtime** = productive time / time held (time held: the allocations' elapsed time with accounting, else the
  total wall plus the gaps before restarts in the same allocation); **program** = MFU, the step-time-weighted mean
  of the kept records' `mfu` (known where the device's peak is: a GPU, or `monitor.peak_tflops`). **Overall** =
  their product; the part with the lowest value lost the most.
"""


@dataclass(frozen=True)
class Prices:
    node_hour: float = 0.0
    gpu_hour: float = 0.0
    currency: str = "USD"

    @classmethod
    def of(cls, cfg: dict) -> Prices:
        """From config.yaml's ``cost`` section as a plain dict (checked when the run was submitted; a value that is
        not a number reads as no price)."""
        section = cfg.get("cost") if isinstance(cfg.get("cost"), dict) else {}
        node, gpu = number(section, "node_hour") or 0.0, number(section, "gpu_hour") or 0.0
        return cls(max(0.0, node), max(0.0, gpu), str(section.get("currency") or "USD"))

    @property
    def priced(self) -> bool:
        return self.node_hour > 0 or self.gpu_hour > 0


@dataclass(frozen=True)
class Usage:
    source: str  # "sacct" or "launches"
    why: str  # why the launches were used rather than accounting ("" with sacct, or without Slurm jobs)
    allocations: int  # runs of jobs (sacct) or launches
    held_s: float  # the time resources were held, summed over the allocations
    node_s: float
    gpu_s: float | None  # None: unknown (launches recorded before the start event named the device)
    queued_s: float | None

    @property
    def node_hours(self) -> float:
        return self.node_s / 3600

    @property
    def gpu_hours(self) -> float | None:
        return self.gpu_s / 3600 if self.gpu_s is not None else None


@dataclass(frozen=True)
class Split:
    scheduling: float | None
    runtime: float | None
    program: float | None

    def parts(self) -> list[tuple[str, float]]:
        named = (("scheduling", self.scheduling), ("runtime", self.runtime), ("program", self.program))
        return [(name, value) for name, value in named if value is not None]

    @property
    def overall(self) -> float | None:
        parts = self.parts()
        return math.prod(v for _, v in parts) if parts else None

    @property
    def worst(self) -> str | None:
        """The part that lost the most (the lowest)."""
        parts = self.parts()
        return min(parts, key=lambda p: p[1])[0] if parts else None


@dataclass(frozen=True)
class Cost:
    usage: Usage
    prices: Prices
    split: Split
    tokens: float | None  # the recipe's units seen by the trained model
    unit: str

    @property
    def total(self) -> float | None:
        if self.prices.node_hour > 0:
            return self.usage.node_hours * self.prices.node_hour
        if self.prices.gpu_hour > 0 and self.usage.gpu_hours is not None:
            return self.usage.gpu_hours * self.prices.gpu_hour
        return None

    @property
    def per_million(self) -> float | None:
        total = self.total
        return total / (self.tokens / 1e6) if total is not None and self.tokens else None

    def metrics(self) -> dict[str, float]:
        """The tracker's metrics of the cost and the goodput split (those that are known)."""
        values = {
            "cost/node_hours": self.usage.node_hours,
            "cost/gpu_hours": self.usage.gpu_hours,
            "cost/held_s": self.usage.held_s,
            "cost/queued_s": self.usage.queued_s,
            "cost/total": self.total,
            "cost/per_million_units": self.per_million,
            "goodput/scheduling": self.split.scheduling,
            "goodput/runtime": self.split.runtime,
            "goodput/program": self.split.program,
            "goodput/overall": self.split.overall,
        }
        return {k: float(v) for k, v in values.items() if v is not None}


def from_launches(log: RunLog, why: str = "") -> Usage:
    """Each launch's wall time x its nodes and (on GPUs) its ranks. A gap after a launch that failed, before a
    restart in the same allocation (the same Slurm job and run of it, or the same local launcher), holds the
    resources too; a gap before another job or run of a job (a requeue, a chain's next link) was queued, and so
    was the time from the first submission to the first launch. A local run stopped and resumed later was neither."""
    node_s, gpu_s = 0.0, 0.0
    for launch in log.launches:
        nodes, world = launch.event.get("nodes"), number(launch.event, "world_size") or 0
        node_s += launch.wall_s * (len(nodes) if isinstance(nodes, list) else 1)
        device = launch.event.get("device")
        gpu_s = None if device is None or gpu_s is None else gpu_s + (launch.wall_s * world if device == "cuda" else 0)
    held_gaps = queued_gaps = 0.0
    for a, b in pairwise(log.launches):
        gap = max(0.0, b.start - a.end)
        job_a, job_b = a.event.get("slurm_job_id"), b.event.get("slurm_job_id")
        allocation = (job_a, a.event.get("slurm_restart_count")) == (job_b, b.event.get("slurm_restart_count"))
        if allocation and (a.end_event is None or a.end_event.get("event") == EVENT_HANG):
            held_gaps += gap  # restarted in the job after a failure
        elif job_b and not allocation:
            queued_gaps += gap
    acc = log.accounting
    queued = (acc.queued_first_s or 0.0) + queued_gaps if log.launches else None
    return Usage("launches", why, len(log.launches), acc.total_wall_s + held_gaps, node_s, gpu_s, queued)


def from_allocations(runs: list[slurmctl.Allocation], now: float) -> Usage:
    """Accounting's runs of the run's jobs: elapsed x nodes and GPUs; queued from when each run could start (its
    submission, its dependency met for a chain's link, the previous run's end for a requeue) to its start, a
    pending one that could start until ``now``."""
    held = node_s = gpu_s = queued = 0.0
    by_job: dict[str, list[slurmctl.Allocation]] = {}
    for a in runs:
        by_job.setdefault(a.job_id, []).append(a)
        held += a.elapsed_s
        node_s += a.elapsed_s * a.nodes
        gpu_s += a.elapsed_s * a.gpus
    for job_runs in by_job.values():
        previous_end = None
        for a in sorted(job_runs, key=lambda a: (a.start is None, a.start or 0.0, a.submit or 0.0)):
            known = [t for t in (a.submit, a.eligible, previous_end) if t is not None]
            # a pending link whose dependency is not met has no Eligible yet: it is not waiting for the scheduler
            since = max(known) if known and (a.eligible is not None or a.start is not None) else None
            until = a.start if a.start is not None else (now if a.state == "PENDING" else None)
            if since is not None and until is not None:
                queued += max(0.0, until - since)
            previous_end = a.end or previous_end
    return Usage("sacct", "", len(runs), held, node_s, gpu_s, queued)


def program_goodput(log: RunLog) -> float | None:
    """The step-time-weighted mean MFU of the kept records (None where no record has one)."""
    weighted = [(s.get("mfu"), s.scaled("step_time_s")) for s in log.kept if s.get("mfu") is not None]
    total = sum(w for _, w in weighted)
    if total > 0:
        return sum(m * w for m, w in weighted) / total
    return sum(m for m, _ in weighted) / len(weighted) if weighted else None


def split(log: RunLog, usage: Usage) -> Split:
    held, queued = usage.held_s, usage.queued_s
    return Split(
        scheduling=held / (held + queued) if queued is not None and held + queued > 0 else None,
        runtime=min(1.0, log.accounting.productive_s / held) if held > 0 else None,
        program=program_goodput(log),
    )


def _tokens(log: RunLog) -> tuple[float | None, str]:
    """The trained model's tokens as a number (None where unknown) and the recipe's name for them."""
    tokens = log.tokens_seen
    units = [s.raw["unit"] for s in sorted(log.kept, key=lambda s: s.step) if isinstance(s.raw.get("unit"), str)]
    tokens = float(tokens) if isinstance(tokens, (int, float)) and not isinstance(tokens, bool) else None
    return tokens, units[-1] if units else "tokens"


def costs(rundirs: list[RunDir], logs: list[RunLog], configs: list[dict] | None = None) -> list[Cost]:
    """Each run's cost (its prices from ``configs``, else from its config.yaml), the jobs' accounting asked for in
    one sacct call."""
    configs = configs if configs is not None else [config_dict(d) for d in rundirs]
    ids = [job_ids(d) for d in rundirs]
    known, why = slurmctl.allocations(j for run in ids for j in run)
    now = time.time()
    out = []
    for run_ids, log, cfg in zip(ids, logs, configs, strict=True):
        missing = [j for j in run_ids if j not in known]
        if not run_ids:
            usage = from_launches(log)
        elif why or missing:
            usage = from_launches(log, why or f"accounting has no record of job {', '.join(missing)}")
        else:
            usage = from_allocations([a for j in run_ids for a in known[j]], now)
        tokens, unit = _tokens(log)
        out.append(Cost(usage, Prices.of(cfg), split(log, usage), tokens, unit))
    return out


def cost_of(rundir: RunDir, log: RunLog, cfg: dict) -> Cost:
    return costs([rundir], [log], [cfg])[0]


def money(value: float | None, prices: Prices) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f} {prices.currency}" if abs(value) >= 1 else f"{value:.4g} {prices.currency}"


def summary_hours(cost: Cost) -> str:
    return f"{cost.usage.node_hours:.4g}, {_hours(cost.usage.gpu_hours)}"


def _hours(value: float | None) -> str:
    return f"{value:.4g}" if value is not None else "unknown"


def percent(value: float | None) -> str:
    return f"{100 * value:.1f} %" if value is not None else "-"


def lines(cost: Cost) -> list[str]:
    """report.md's cost and goodput-split sections."""
    u, p, s = cost.usage, cost.prices, cost.split
    if u.source == "sacct":
        source = f"Slurm accounting (sacct): {u.allocations} run(s) of the run's jobs"
    else:
        source = f"the launches' wall time and shape ({u.allocations} launch(es))"
        source += f"; not sacct: {u.why}" if u.why else ""
    price = (
        f"{p.node_hour:g} {p.currency} a node-hour"
        if p.node_hour > 0
        else f"{p.gpu_hour:g} {p.currency} a GPU-hour"
        if p.gpu_hour > 0
        else "no price in the config (cost.node_hour or cost.gpu_hour)"
    )
    out = [
        "",
        "## Cost",
        "",
        f"From {source}; price: {price}.",
        "",
        "| | |",
        "|---|---|",
        f"| node-hours | {u.node_hours:.4g} |",
        f"| GPU-hours | {_hours(u.gpu_hours)} |",
        f"| time held (allocations) | {u.held_s:.1f} s |",
        f"| queued | {'-' if u.queued_s is None else f'{u.queued_s:.1f} s'} |",
        f"| cost | {money(cost.total, p)} |",
        f"| cost per million {cost.unit} | {money(cost.per_million, p)} |",
        "",
        "## Goodput, split (scheduling x runtime x program)",
        "",
        "| part | goodput | what it loses |",
        "|---|---|---|",
        f"| scheduling | {percent(s.scheduling)} | time queued before and between allocations |",
        f"| runtime | {percent(s.runtime)} | start-up, restarts, recomputed steps, checkpoints, data and eval |",
        f"| program | {percent(s.program)} | the model's FLOPs below the device's peak (MFU) |",
        f"| **overall** | **{percent(s.overall)}** | |",
    ]
    if s.worst is not None:
        out += ["", f"The most was lost to **{s.worst}** ({percent(dict(s.parts())[s.worst])})."]
    if p.gpu_hour > 0 and u.gpu_hours is None:
        out += ["", "GPU-hours are unknown: the launches' start events do not name their device (recorded before it "
                "was), so the run has no cost by the GPU-hour."]  # fmt: skip
    if s.program is None:
        out += ["", "Program goodput is unknown: no record has an MFU (set monitor.peak_tflops off GPUs)."]
    return out


def summary_line(cost: Cost) -> str:
    """One line for the report's output on the terminal."""
    u, s = cost.usage, cost.split
    priced = f", {money(cost.total, cost.prices)} ({money(cost.per_million, cost.prices)} per M {cost.unit})"
    worst = f"; most lost to {s.worst}" if s.worst else ""
    return (
        f"cost: {u.node_hours:.4g} node-hours, {_hours(u.gpu_hours)} GPU-hours ({u.source})"
        + (priced if cost.total is not None else "")
        + f"; goodput split: scheduling {percent(s.scheduling)}, runtime {percent(s.runtime)}, "
        f"program {percent(s.program)}{worst}"
    )
