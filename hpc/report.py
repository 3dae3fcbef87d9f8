"""``python -m hpc report RUN_DIR [--out DIR]``: PNG plots and a markdown summary of a run, with its goodput.

Reads what the trainer wrote into the run directory (metrics.jsonl, metrics.discarded.jsonl, history.jsonl,
summary.json, config.yaml) and writes report.md plus PNG figures into RUN_DIR/report/ (or --out), private to the
user (0700). Works on a finished run and on one still in progress; torch-free, and matplotlib is imported only
when the figures are drawn (hpc/plots.py), with the Agg canvas, so no display is needed.

The definitions (launch, total wall, goodput, lost time) are DEFINITIONS below, which report.md repeats;
hpc/runlog.py implements them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hpc import cost as costing
from hpc.plots import PART_LABELS, render
from hpc.policy.badnodes import bad_node_events, node_changes
from hpc.runlog import RunLog, analyze, config_dict
from hpc.status import status
from hpc.tracksync import sync
from rundir import RunDir
from rundir.allreduce_plan import plan_table
from rundir.contract import EVENT_BAD_NODE, EXIT_USER_ERROR, PARTS
from rundir.stopsignal import newest_budget

DEFINITIONS = """\
- **Launch**: one start of the ranks (a `start` or `resume` event in history.jsonl). Its wall time runs from the
  event's `process_start` (when rank 0's process started; else the event's time) to its `stopped`, `done` or
  `hang` event, else to the latest `time` of its records in metrics.jsonl or metrics.discarded.jsonl (a launch
  killed hard writes no end event), else to its start. **Restarts** = launches - 1.
- **Total wall** = the sum of the launches' wall times. Time queued before and between launches is not in it.
- **Step time** of a record = `step_time_s` x the steps it stands for: with `train.log_every` > 1 a record stands
  for `step - previous step` steps (the previous record of the same launch, or the step the launch started from).
  The six step-time parts (`time_data_s` ... `time_sync_s`, per step) are scaled the same way.
- **Productive** = sum over kept records (metrics.jsonl) of step time - `time_ckpt_s` - `time_data_s`;
  **goodput** = productive / total wall.
- **Lost time**: start-up + teardown (per launch: its wall minus the step time of all its records, kept or
  discarded, and minus their evaluation time), evaluation (`time_eval_s`: eval time since the previous record,
  kept out of the step time by the trainer; all records, not scaled), recomputed steps (step time of the
  records in metrics.discarded.jsonl: computed, then thrown away by a resume from an earlier checkpoint),
  checkpoint stalls (`time_ckpt_s`) and data wait (`time_data_s`) of kept records. Productive + lost time = total
  wall; a remainder is shown as *other* (~0 for consistent files).
- **Stragglers**: the trainer's straggler checks (`rank_step_time_s`, `stragglers` in the records), counted over
  kept and discarded records; the ratio is the one the trainer reported (a rank's step time relative to the
  typical rank's).
"""


class ReportError(Exception):
    pass


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = round(seconds, 6) or 0.0  # no "-0.0 s" from rounding errors
    sign, s = ("-" if seconds < 0 else ""), abs(seconds)
    if s < 60:
        return f"{sign}{s:.1f} s"
    h, rem = divmod(int(round(s)), 3600)
    m, sec = divmod(rem, 60)
    return f"{sign}{h}h {m:02d}m {sec:02d}s" if h else f"{sign}{m}m {sec:02d}s"


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def _check(rundir: RunDir) -> None:
    root, metrics = rundir.root, rundir.metrics
    if not root.exists():
        raise ReportError(f"{root} does not exist: give the run directory that `python -m hpc.submit` created.")
    if not root.is_dir():
        raise ReportError(f"{root} is not a directory: give the run directory that `python -m hpc.submit` created.")
    if not metrics.exists():
        raise ReportError(
            f"{metrics} does not exist: the run has no metrics yet (rank 0 appends one line per logged step once "
            f"training runs). See whether its job has started with `python -m hpc status {root}`."
        )


def _final(log: RunLog, key: str, summary_key: str) -> float | None:
    if log.summary and isinstance(log.summary.get(summary_key), (int, float)):
        return float(log.summary[summary_key])
    values = [s.get(key) for s in sorted(log.kept, key=lambda s: s.step) if s.get(key) is not None]
    return values[-1] if values else None


def _topology(topo: object) -> str | None:
    if isinstance(topo, dict) and {"nodes", "ranks_per_node"} <= topo.keys():
        return f"{topo['nodes']} nodes x {topo['ranks_per_node']} ranks"
    return str(topo) if topo else None


def facts(log: RunLog, cfg: dict) -> dict:
    """The headline numbers of the report."""
    summary = log.summary or {}
    last = max(log.kept, key=lambda s: s.step)
    world = summary.get("world_size") or (log.launches[-1].event.get("world_size") if log.launches else None)
    return {
        "name": (cfg.get("job") or {}).get("name") or log.rundir.root.name,
        "complete": log.summary is not None,
        "final_step": summary.get("final_step", last.step),
        "steps": (cfg.get("train") or {}).get("steps"),
        "final_loss": _final(log, "loss", "final_loss"),
        "final_eval_loss": _final(log, "eval_loss", "final_eval_loss"),
        "tokens_seen": log.tokens_seen,
        "world_size": world,
        "topology": _topology(summary.get("topology")),
        "trainer_wall_s": summary.get("wall_time_s"),
        "stop_lead": newest_budget(log.rundir, (cfg.get("job") or {}).get("signal_lead_s")),
        "tracking": _tracking(log.rundir),
        "cost": costing.cost_of(log.rundir, log, cfg),
    }


def _tracking(rundir: RunDir) -> dict | None:
    """tracking.json: the tracker run and how far it has the metrics (None when the run is not tracked)."""
    try:
        return json.loads(rundir.tracking.read_text())
    except (OSError, ValueError):
        return None


def tracking_line(f: dict) -> str | None:
    t = f.get("tracking")
    if not t:
        return None
    where = f"{t.get('backend')} {t.get('uri')} run {t.get('run_id') or '(not made yet: the tracker was unreachable)'}"
    unsent = t.get("unsent") or []
    gap = f"; steps {unsent[0]}..{unsent[1]} not sent when a launch ended" if len(unsent) == 2 else ""
    return f"tracker: {where}, steps sent through {t.get('sent_through', 0)}{gap}"


def _world(event: dict) -> str:
    """A launch's world size and, where it ran on named nodes, which (the world shrinks when nodes are left out)."""
    world = event.get("world_size", "-")
    nodes = event.get("nodes")
    return f"{world} on {', '.join(nodes)}" if isinstance(nodes, list) and nodes else f"{world}"


def markdown(log: RunLog, f: dict, images: list[tuple[str, str]]) -> str:
    """report.md: the summary, launches, goodput, step time, the all-reduce plan, stragglers, plots, definitions."""
    acc = log.accounting
    goodput = f"{100 * acc.goodput:.1f} %" if acc.goodput is not None else "-"
    lines = [
        f"# Run report: {_cell(f['name'])}",
        "",
        f"Run directory: `{log.rundir.root}`  ",
        f"State: {'complete (summary.json)' if f['complete'] else 'in progress, or ended without a summary'}  ",
        f"Written: {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by `python -m hpc report`",
        *_summary_lines(log, f, goodput),
        *_launch_lines(log),
        *_goodput_lines(acc, goodput),
        *costing.lines(f["cost"]),
        *step_time_lines([{**x.raw, **{k: x.get(k) for k in TIMED}} for x in log.kept]),
        *_plan_lines((log.summary or {}).get("allreduce_plan")),
        *_straggler_lines(log.stragglers),
        "",
        "## Plots",
        "",
    ]
    for caption, name in images:
        lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    lines += ["## Definitions", "", DEFINITIONS + costing.DEFINITIONS]
    return "\n".join(lines)


def _summary_lines(log: RunLog, f: dict, goodput: str) -> list[str]:
    acc = log.accounting
    steps = f"{f['final_step']}" + (f" of {f['steps']}" if f["steps"] else "")
    world = f"{f['world_size']}" + (f" ({_cell(f['topology'])})" if f["topology"] else "") if f["world_size"] else "-"
    tokens = f"{f['tokens_seen']:,}" if isinstance(f["tokens_seen"], int) else _cell(f["tokens_seen"] or "-")
    rate = [s.get("tokens_per_s") for s in log.kept if s.get("tokens_per_s") is not None]
    lines = [
        "",
        "## Summary",
        "",
        "| | |",
        "|---|---|",
        f"| final loss | {_fmt(f['final_loss'])} |",
        f"| final eval loss | {_fmt(f['final_eval_loss'])} |",
        f"| steps | {steps} |",
        f"| tokens seen | {tokens} |",
        f"| world size | {world} |",
        f"| wall time (sum of launches) | {duration(acc.total_wall_s)} |",
    ]
    if f["trainer_wall_s"] is not None:
        lines.append(f"| trainer's own elapsed time (summary.json) | {duration(f['trainer_wall_s'])} |")
    lines += [
        f"| restarts | {log.restarts} |",
        f"| goodput | {goodput} |",
        f"| node-hours, GPU-hours | {costing.summary_hours(f['cost'])} |",
        f"| cost | {costing.money(f['cost'].total, f['cost'].prices)} |",
        f"| mean tokens/s (kept records) | {sum(rate) / len(rate):,.0f} |" if rate else "| mean tokens/s | - |",
    ]
    lead = f.get("stop_lead")
    if lead is not None:
        how = "measured at a stop" if lead.measured else "estimated from a step and a checkpoint save"
        lines.append(
            f"| stop signal lead | {lead.lead_s:g} s for a stop of {lead.needed_s:.1f} s ({how}): "
            f"{'ok' if lead.ok else '**too short**'} |"
        )
    mfu = [s.get("mfu") for s in log.kept if s.get("mfu") is not None]
    if mfu:
        lines.append(f"| MFU, mean of kept records | {sum(mfu) / len(mfu):.3g} |")
    mem = [s.get("peak_mem_mb") for s in log.kept if s.get("peak_mem_mb") is not None]
    if mem:
        lines.append(f"| peak memory (rank 0) | {max(mem):,.0f} MB |")
    tracked = tracking_line(f)
    if tracked:
        lines.append(f"| tracking | {_cell(tracked.removeprefix('tracker: '))} |")
    if lead is not None and not lead.ok:
        lines += ["", f"**Warning:** {_cell(lead.describe())}."]
    return lines


def _launch_lines(log: RunLog) -> list[str]:
    """The launches, the bad nodes, and the time queued (not part of the wall time)."""
    acc = log.accounting
    lines = [
        "",
        "## Launches",
        "",
        "| # | launch | Slurm job | kind | world | steps | wall | step time | start-up + teardown | "
        "recomputed steps | ended |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in log.launches:
        lines.append(
            f"| {x.index + 1} | {_cell(x.launch_id or '-')} | {_cell(x.slurm or '-')} | {x.kind} | "
            f"{_cell(_world(x.event))} | {x.start_step} → {x.last_step} | {duration(x.wall_s)} | "
            f"{duration(x.step_time_s)} | {duration(x.startup_teardown_s)} | {x.discarded_steps} | {_cell(x.ended)} |"
        )
    changes = node_changes(log.rundir)
    if changes:
        current = {e["node"] for e in bad_node_events(log.rundir)}
        lines += ["", "## Bad nodes (left out of later launches until taken back)", ""]
        lines += [f"Bad now: {_cell(', '.join(sorted(current)) or 'none')}.", ""]
        lines += ["| when | node | change | launch | evidence |", "|---|---|---|---|---|"]
        for e in changes:
            named = e.get("event") == EVENT_BAD_NODE
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(e.get("time", 0))))
            lines.append(
                f"| {when} | {_cell(e.get('node'))} | {'named bad' if named else 'taken back'} | "
                f"{_cell(e.get('launch') or '-')} | {_cell(e.get('evidence') if named else e.get('how'))} |"
            )
    queued = []
    if len(log.launches) > 1:
        queued.append(f"queued between launches: {duration(acc.between_launches_s)}")
    if acc.queued_first_s is not None:
        queued.append(f"from the first submission to the first launch: {duration(acc.queued_first_s)}")
    if queued:
        lines += ["", f"Not in the wall time: {'; '.join(queued)}."]
    return lines


def _goodput_lines(acc, goodput: str) -> list[str]:
    lines = [
        "",
        "## Goodput",
        "",
        f"Goodput = productive / total wall = {duration(acc.productive_s)} / {duration(acc.total_wall_s)} "
        f"= **{goodput}**.",
        "",
        "| | time | seconds | share of wall |",
        "|---|---|---|---|",
    ]
    total = acc.total_wall_s
    for what, seconds in acc.rows():
        seconds = round(seconds, 6) or 0.0
        share = f"{100 * seconds / total:.1f} %" if total > 0 else "-"
        lines.append(f"| {what} | {duration(seconds)} | {seconds:.1f} | {share} |")
    lines.append(f"| **total wall** | {duration(total)} | {total:.1f} | 100 % |")
    return lines


def _plan_lines(plan: dict | None) -> list[str]:
    if not plan:
        return []
    return [
        "",
        "## All-reduce plan (comm.allreduce=auto)",
        "",
        f"Measured at start-up in {plan['measured_s']:.2f} s on {plan['topology'][0]} nodes x "
        f"{plan['topology'][1]} ranks: {plan['timing']}; the fastest per bucket size.",
        "",
        *plan_table(plan),
    ]


def _straggler_lines(st) -> list[str]:
    lines = ["", "## Stragglers", ""]
    if not st.checks:
        return [*lines, "No straggler checks in the metrics (no record has `rank_step_time_s`)."]
    ranks = ", ".join(str(r) for r in sorted(st.by_rank)) or "none"
    worst = (
        f"; worst ratio {st.worst['ratio']:.2f} (rank {st.worst['rank']} on {_cell(st.worst.get('host') or '?')}"
        f" at step {st.worst['step']})"
        if st.worst
        else ""
    )
    lines.append(
        f"{st.detections} straggler detection{'s' if st.detections != 1 else ''} on {st.flagged_checks} of "
        f"{st.checks} straggler checks; ranks flagged: {ranks}{worst}."
    )
    if st.by_rank:
        lines += ["", "| rank | host | node | detections | worst ratio |", "|---|---|---|---|---|"]
        for rank, x in sorted(st.by_rank.items()):
            lines.append(
                f"| {rank} | {_cell(x['host'] or '-')} | {_cell(x['node'])} | {x['count']} | "
                f"{_fmt(x['worst_ratio'], '.2f')} |"
            )
    return lines


def _median(values: list[float]) -> float:
    values = sorted(values)
    n = len(values)
    return (values[n // 2] + values[(n - 1) // 2]) / 2 if n else 0.0


TIMED = ("step_time_s", *(f"time_{part}_s" for part in PARTS))


def _dims(record: dict) -> dict[str, float]:
    dims = record.get("comm_by_dim")
    if not isinstance(dims, dict):
        return {}
    return {str(d): float(v) for d, v in dims.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def step_time_lines(records: list[dict]) -> list[str]:
    """Where a step's time goes on rank 0: the median of each part over the kept records after the first (start-up),
    and the exposed communication per parallel dimension where the trainer measured it."""
    timed = [r for r in records if r.get("step_time_s")][1:]
    if not timed:
        return []
    step = _median([r["step_time_s"] for r in timed])
    lines = [
        "",
        f"## Step time (rank 0, median of {len(timed)} records after the first)",
        "",
        "| part | per step | share |",
        "|---|---|---|",
    ]
    dims = sorted({d for r in timed for d in _dims(r)})
    for part in PARTS:
        seconds = _median([r.get(f"time_{part}_s") or 0.0 for r in timed])
        lines.append(f"| {PART_LABELS[part]} | {1000 * seconds:.1f} ms | {100 * seconds / step:.1f} % |")
        if part == "comm":
            for d in dims:
                seconds = _median([_dims(r).get(d, 0.0) for r in timed])
                lines.append(f"| &nbsp;&nbsp;of which `{d}` | {1000 * seconds:.1f} ms | {100 * seconds / step:.1f} % |")
    lines.append(f"| **step** | {1000 * step:.1f} ms | 100 % |")
    if dims:
        lines += [
            "",
            "Exposed communication per parallel dimension: the time rank 0 waited in that dimension's collectives "
            "(`comm_by_dim` in metrics.jsonl; medians do not add up exactly).",
        ]
    return lines


def summary_lines(log: RunLog, f: dict) -> list[str]:
    acc = log.accounting
    eval_part = f", eval loss {f['final_eval_loss']:.4f}" if f["final_eval_loss"] is not None else ""
    steps = f"{f['final_step']}" + (f"/{f['steps']}" if f["steps"] else "")
    lost = ", ".join(f"{what.split(' (')[0]} {duration(s)}" for what, s in acc.rows()[1:] if abs(s) >= 0.05)
    goodput = f"{100 * acc.goodput:.1f}%" if acc.goodput is not None else "-"
    killed = sum(1 for x in log.launches[:-1] if x.end_event is None)
    lead = f.get("stop_lead")
    warning = [f"warning: {lead.describe()}"] if lead is not None and not lead.ok else []
    return [
        f"final loss {_fmt(f['final_loss'])}{eval_part} at step {steps}"
        + ("" if f["complete"] else " (in progress, or ended without a summary)"),
        f"goodput {goodput} of {duration(acc.total_wall_s)} wall" + (f" (lost: {lost})" if lost else ""),
        f"restarts {log.restarts} ({len(log.launches)} launch{'es' if len(log.launches) != 1 else ''}"
        + (f", {killed} killed without an end event" if killed else "")
        + f"); {log.stragglers.detections} straggler detection{'s' if log.stragglers.detections != 1 else ''}",
        costing.summary_line(f["cost"]),
        *([tracking_line(f)] if tracking_line(f) else []),
        *warning,
    ]


def write_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, RunLog, dict]:
    """Analyze the run and write report.md and the figures; ReportError for a bad run directory."""
    rundir = RunDir(Path(run_dir).absolute())
    try:
        _check(rundir)
        log = analyze(rundir)
    except OSError as exc:
        raise ReportError(f"cannot read {exc.filename or rundir.root}: {exc.strerror or exc}.") from None
    if not log.kept:
        raise ReportError(
            f"{rundir.metrics} has no complete step record yet (it is empty, or holds only a torn line): the run "
            f"has no metrics to report. See whether its job is running with `python -m hpc status {rundir.root}`."
        )
    target = Path(out).absolute() if out else rundir.report
    try:
        if not target.is_dir():
            target.mkdir(mode=0o700, parents=True)
            os.chmod(target, 0o700)  # private like the run directory, whatever the umask
        f = facts(log, config_dict(rundir))
        images = render(log, target, f["name"])
        md = target / "report.md"
        md.write_text(markdown(log, f, images) + "\n")
    except ImportError as exc:
        raise ReportError(
            f"the report's figures need matplotlib ({exc}): pip install -r envs/requirements-cpu.txt (or -cuda.txt)."
        ) from None
    except OSError as exc:
        raise ReportError(f"cannot write the report into {target}: {exc.strerror or exc}.") from None
    return md, log, f


def main(run_dir: str, out: str | None = None) -> int:
    try:
        started = time.perf_counter()
        md, log, f = write_report(run_dir, out)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"report: {md} ({time.perf_counter() - started:.1f} s)")
    for line in summary_lines(log, f):
        print(f"  {line}")
    _send_to_tracker(RunDir(Path(run_dir).absolute()), md.parent, f)
    return 0


def _send_to_tracker(rundir: RunDir, folder: Path, f: dict) -> None:
    """The report's markdown and figures, the cost and the goodput split to the run's tracker, and the steps it lacks
    once no launch runs."""
    files = [(p, "report") for p in sorted(folder.iterdir()) if p.suffix in (".md", ".png")]
    cost = f["cost"]
    tags = {"hpc.cost_source": cost.usage.source, "hpc.currency": cost.prices.currency}
    try:
        idle = status(rundir)["state"] in ("completed", "pruned", "stopped", "failed", "paused", "not started")
        line = sync(rundir, files, idle=idle, metrics=(cost.metrics(), int(f["final_step"]), tags))
    except Exception as exc:  # the report is written; the tracker is an extra
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        print(f"warning: the report was not sent to the tracker: {first}", file=sys.stderr)
        return
    if line:
        print(line)
