"""The report's PNG figures, drawn from a RunLog with matplotlib's Agg canvas (imported only when plotting).

Every time axis is wall-clock time since the first launch started, with restarts as vertical lines and the time
between launches shaded; step axes mark the step each later launch resumed from.
"""

from __future__ import annotations

import math
from itertools import pairwise
from pathlib import Path

from hpc.runlog import RunLog, Step
from rundir.contract import EVENT_DONE, EVENT_HANG, EVENT_STOPPED, PART_KEYS, PARTS

DPI = 110
MANY_RANKS = 256  # above it, the per-rank chart draws a line per rank instead of a bar
#: The legend of each step-time part (rundir.contract.PARTS), stacked in PARTS order.
PART_LABELS = {
    "data": "data wait",
    "compute": "forward + backward",
    "comm": "exposed communication",
    "optim": "optimizer",
    "ckpt": "checkpoint stall",
    "sync": "metrics sync / logging",
}
RESTART = {"color": "tab:red", "linestyle": "--", "linewidth": 1.0}
OUTSIDE = {"loc": "center left", "bbox_to_anchor": (1.0, 0.5)}
DISCARDED = {"color": "0.6", "marker": ".", "linestyle": "none", "markersize": 4}


def time_unit(span_s: float) -> tuple[float, str]:
    """(divisor, name) for a time axis that spans span_s seconds."""
    if span_s < 180:
        return 1.0, "s"
    if span_s < 3 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


def render(log: RunLog, out: Path, title: str) -> list[tuple[str, str]]:
    """Write the figures into out; returns (caption, file name) pairs in the order the report shows them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    span = max([x.end - log.t0 for x in log.launches] + [(s.time or log.t0) - log.t0 for s in log.kept] + [1.0])
    unit = time_unit(span)
    written = []

    def save(fig: Figure, name: str, caption: str) -> None:
        FigureCanvasAgg(fig)
        fig.savefig(out / name, dpi=DPI)
        written.append((caption, name))

    save(_loss(Figure, log, unit, title), "loss.png", "Loss and eval loss vs step and vs wall-clock time")
    save(_throughput(Figure, log, title), "throughput.png", "Throughput vs step")
    save(_step_time(Figure, log, title), "step_time.png", "Step-time breakdown vs step")
    if log.stragglers.checks:
        save(_ranks(Figure, log, title), "ranks.png", "Per-rank step-time spread and stragglers")
    save(_wall(Figure, log, unit, title), "wall.png", "Launches over time and where the wall time went")
    return written


def _series(steps: list[Step], key: str, *, x: str = "step", t0: float = 0.0, div: float = 1.0):
    """(xs, ys) of a field against step or time; against time a line breaks between launches (a NaN point)."""
    pts = sorted(
        (s.step if x == "step" else (s.time - t0) / div, s.get(key), s.launch)
        for s in steps
        if s.get(key) is not None and (x == "step" or s.time is not None)
    )
    xs, ys = [], []
    for i, (px, py, launch) in enumerate(pts):
        if x == "time" and i and launch != pts[i - 1][2]:
            xs.append(px)
            ys.append(math.nan)
        xs.append(px)
        ys.append(py)
    return xs, ys


def _mark_resumes(ax, log: RunLog) -> None:
    for i, launch in enumerate(log.launches[1:]):
        ax.axvline(launch.start_step, label="resumed from (launch boundary)" if i == 0 else None, **RESTART)


def _mark_restarts(ax, log: RunLog, div: float) -> None:
    for i, (a, b) in enumerate(pairwise(log.launches)):
        ax.axvline((b.start - log.t0) / div, label="restart" if i == 0 else None, **RESTART)
        if b.start > a.end:
            label = "between launches" if i == 0 else None
            ax.axvspan((a.end - log.t0) / div, (b.start - log.t0) / div, color="0.85", label=label)


def _finish(ax, xlabel: str, ylabel: str, title: str, legend: str = "upper right") -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a fixed place: "best" takes seconds on long runs
        ax.legend(fontsize="small", **(OUTSIDE if legend == "outside" else {"loc": legend}))


def _loss(Figure, log: RunLog, unit: tuple[float, str], title: str):
    div, name = unit
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    fig.suptitle(f"{title}: loss")
    by_step, by_time = fig.subplots(1, 2)
    for ax, x in ((by_step, "step"), (by_time, "time")):
        kw = {"x": x, "t0": log.t0, "div": div}
        train = _series(log.kept, "loss", **kw)
        ax.plot(*train, color="tab:blue", linewidth=1.2, label="train loss")
        ev = _series(log.kept, "eval_loss", **kw)
        if ev[0]:
            marker = "o" if len(ev[0]) <= 200 else None
            ax.plot(*ev, color="tab:orange", marker=marker, markersize=3, linewidth=1.2, label="eval loss")
        values = [y for y in train[1] + ev[1] if not math.isnan(y)]
        if values and min(values) > 0 and max(values) / min(values) > 10:
            ax.set_yscale("log")  # a long run's late progress is invisible on a linear scale
        gone = _series(log.discarded, "loss", **kw)
        if gone[0]:
            ax.plot(*gone, label="discarded (recomputed after a resume)", **DISCARDED)
        if x == "step":
            _mark_resumes(ax, log)
        else:
            _mark_restarts(ax, log, div)
    _finish(by_step, "step", "loss", "vs step")
    _finish(by_time, f"wall-clock time since the first launch started ({name})", "loss", "vs wall-clock time")
    return fig


def _throughput(Figure, log: RunLog, title: str):
    has_mfu = any(s.get("mfu") is not None for s in log.kept)
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    fig.suptitle(f"{title}: throughput")
    axes = fig.subplots(1, 2 if has_mfu else 1, squeeze=False)[0]
    ax = axes[0]
    ax.plot(*_series(log.kept, "tokens_per_s"), color="tab:green", linewidth=1.2, label="tokens/s")
    gone = _series(log.discarded, "tokens_per_s")
    if gone[0]:
        ax.plot(*gone, label="discarded (recomputed after a resume)", **DISCARDED)
    _mark_resumes(ax, log)
    ax.set_ylim(bottom=0)
    _finish(ax, "step", "tokens per second (all ranks)", "tokens/s vs step", "lower right")
    if has_mfu:
        xs, ys = _series(log.kept, "mfu")
        pct = max(ys) <= 1.0
        axes[1].plot(xs, [100 * y if pct else y for y in ys], color="tab:purple", linewidth=1.2, label="MFU")
        _mark_resumes(axes[1], log)
        axes[1].set_ylim(bottom=0)
        _finish(axes[1], "step", "model FLOPs utilization (%)", "MFU vs step", "lower right")
    return fig


def _step_time(Figure, log: RunLog, title: str):
    timed = sorted((s for s in log.kept if s.get("step_time_s") is not None), key=lambda s: s.step)
    fig = Figure(figsize=(13, 5), layout="constrained")
    ax = fig.subplots()
    xs = [s.step for s in timed]
    layers = [[s.get(k) or 0.0 for s in timed] for k in PART_KEYS]
    labels = [PART_LABELS[p] for p in PARTS]
    rest = [max(0.0, (s.get("step_time_s") or 0.0) - sum(s.get(k) or 0.0 for k in PART_KEYS)) for s in timed]
    if any(r > 1e-9 for r in rest):
        layers.append(rest)
        labels.append("unattributed")
    if xs:  # a record's times hold for the steps since the previous record: drawn as steps ending at it
        ax.stackplot(xs, layers, labels=labels, alpha=0.85, step="pre")
        total = [s.get("step_time_s") for s in timed]
        ax.plot(xs, total, color="black", linewidth=0.8, drawstyle="steps-pre", label="step time")
    _mark_resumes(ax, log)
    ax.set_ylim(bottom=0)
    _finish(ax, "step", "seconds per step", f"{title}: step-time breakdown (rank 0's record, per step)", "outside")
    return fig


def _rank_times(s: Step) -> list[float]:
    return [float(v) for v in s.raw["rank_step_time_s"] if isinstance(v, (int, float)) and math.isfinite(v)]


def _ranks(Figure, log: RunLog, title: str):
    import statistics

    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    checks = sorted(
        (s for s in log.kept + log.discarded if isinstance(s.raw.get("rank_step_time_s"), list) and _rank_times(s)),
        key=lambda s: (s.step, s.kept),
    )
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    fig.suptitle(f"{title}: step time across ranks (straggler checks)")
    band, bars = fig.subplots(1, 2, width_ratios=[3, 2])
    kept = [(s.step, _rank_times(s)) for s in checks if s.kept]
    if kept:
        xs = [x for x, _ in kept]
        band.fill_between(xs, [min(v) for _, v in kept], [max(v) for _, v in kept], color="tab:blue", alpha=0.25)
        band.plot([], [], color="tab:blue", alpha=0.4, linewidth=6, label="min-max over ranks")
        band.plot(xs, [statistics.median(v) for _, v in kept], color="tab:blue", linewidth=1.2, label="median rank")
        top, low = max(max(v) for _, v in kept), min(min(v) for _, v in kept)
        band.set_ylim(low - 0.05 * (top - low), top + 0.45 * (top - low or top))  # room for the legend
    flagged = [(s.step, max(_rank_times(s))) for s in checks if s.raw.get("stragglers") and s.kept]
    if flagged:
        band.plot(*zip(*flagged, strict=True), "x", color="tab:red", markersize=7, label="straggler detected")
    _mark_resumes(band, log)
    _finish(band, "step", "median step time of a rank (s)", "spread over steps (kept records)", "upper left")

    per_rank: dict[int, list[float]] = {}
    for s in checks:
        for rank, v in enumerate(s.raw["rank_step_time_s"]):
            if isinstance(v, (int, float)) and math.isfinite(v):
                per_rank.setdefault(rank, []).append(v)
    ranks = sorted(per_rank)
    medians = [statistics.median(per_rank[r]) for r in ranks]
    worst = [max(per_rank[r]) for r in ranks]
    slow = [r for r in ranks if r in log.stragglers.by_rank]
    colors = ["tab:red" if r in slow else "tab:blue" for r in ranks]
    if len(ranks) <= MANY_RANKS:
        bars.bar(ranks, medians, color=colors, width=0.8)
    else:  # one line collection, not a rectangle per rank (4,096 bars took 1.5 s to build and draw)
        bars.vlines(ranks, 0, medians, colors=colors, linewidth=max(0.1, 300 / len(ranks)))
    bars.plot(ranks, worst, ".", color="0.4", markersize=3, label="max over checks")
    if slow:  # a marker, visible however thin the bars of many ranks are
        bars.plot(slow, [max(per_rank[r]) for r in slow], "v", color="tab:red", markersize=7)
    bars.axhline(statistics.median(medians), color="black", linewidth=0.8, label="median of ranks")
    bars.xaxis.set_major_locator(MaxNLocator(integer=True))
    bars.set_ylim(0, 1.35 * max(worst))  # room for the legend
    _finish(bars, "rank", "step time over checks (s)", "median per rank (all checks, incl. recomputed)")
    handles = [*bars.get_legend_handles_labels()[0], Patch(color="tab:red", label="flagged as straggler")]
    bars.legend(handles=handles, fontsize="small", loc="upper right")
    return fig


def _wall(Figure, log: RunLog, unit: tuple[float, str], title: str):
    from matplotlib.patches import Patch

    div, name = unit
    fig = Figure(figsize=(13, 5), layout="constrained")
    fig.suptitle(f"{title}: wall-clock time")
    timeline, split = fig.subplots(2, 1, height_ratios=[1, 1])
    colors = {EVENT_DONE: "tab:green", EVENT_STOPPED: "tab:orange", EVENT_HANG: "tab:purple"}
    for launch in log.launches:
        kind = launch.end_event["event"] if launch.end_event else "none"
        start = (launch.start - log.t0) / div
        timeline.barh(0, launch.wall_s / div, left=start, color=colors.get(kind, "tab:gray"), edgecolor="black")
        timeline.text(start, 0.45, f" {launch.index + 1}: {launch.ended}", fontsize="small", va="bottom")
    _mark_restarts(timeline, log, div)
    timeline.set_yticks([])
    timeline.set_ylim(-0.6, 1.2)
    _finish(timeline, f"wall-clock time since the first launch started ({name})", "", "launches")
    ends = {x.end_event["event"] if x.end_event else "none" for x in log.launches}
    handles = [Patch(color=c, label=f"ended: {k}") for k, c in colors.items() if k in ends]
    handles += [Patch(color="tab:gray", label="no end event")] if "none" in ends else []
    timeline.legend(handles=timeline.get_legend_handles_labels()[0] + handles, fontsize="small", **OUTSIDE)

    acc = log.accounting
    left = 0.0
    palette = ["tab:green", "tab:gray", "tab:olive", "tab:red", "tab:orange", "tab:cyan", "tab:brown"]
    total = acc.total_wall_s or 1.0
    for (what, seconds), color in zip(acc.rows(), palette, strict=True):
        if seconds > 0:
            split.barh(0, seconds / div, left=left, color=color, label=f"{what}: {100 * seconds / total:.1f}%")
            left += seconds / div
    split.set_yticks([])
    _finish(split, f"time ({name}), launches' wall summed", "", "where the wall time went (goodput = productive)")
    split.legend(fontsize="small", **OUTSIDE)
    return fig
