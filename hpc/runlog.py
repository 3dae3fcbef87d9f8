"""Where a run's wall-clock time went (torch-free): launches from history.jsonl, logged steps from metrics.jsonl and
metrics.discarded.jsonl, the goodput accounting and the straggler counts that ``python -m hpc report`` shows.

The definitions implemented here (launch, total wall, step time, productive, goodput, lost time) are stated
once, in hpc/report.py's DEFINITIONS, which report.md repeats.

Records are matched to launches by their ``launch`` id, else by time. Without any start event in history.jsonl
one launch is assumed, from step 0 and from the start of the first logged step. Unparsable lines (the torn last
line of a killed writer) are skipped; every field but ``step`` is optional.
"""

from __future__ import annotations

import json
import math
import signal
from dataclasses import dataclass, field
from itertools import pairwise

from rundir import RunDir
from rundir.contract import EVENT_DONE, EVENT_HANG, EVENT_RESUME, EVENT_START, EVENT_STOPPED
from rundir.paths import read_jsonl

START_EVENTS = (EVENT_START, EVENT_RESUME)
END_EVENTS = (EVENT_STOPPED, EVENT_DONE, EVENT_HANG)


def number(obj: dict, key: str) -> float | None:
    """obj[key] as a finite float, else None (missing, null, NaN, not a number)."""
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


@dataclass(eq=False)
class Step:
    """One logged record of metrics.jsonl (kept) or metrics.discarded.jsonl (not kept)."""

    raw: dict
    kept: bool
    launch: int | None = None  # index into RunLog.launches
    gap: int = 1  # how many steps the record stands for
    _numbers: dict = field(default_factory=dict, repr=False)

    @property
    def step(self) -> int:
        return self.raw["step"]

    @property
    def time(self) -> float | None:
        return self.get("time")

    def get(self, key: str) -> float | None:
        try:
            return self._numbers[key]
        except KeyError:
            value = self._numbers[key] = number(self.raw, key)
            return value

    def scaled(self, key: str) -> float:
        """A time field multiplied by the number of steps the record stands for (0 when absent)."""
        return self.gap * (self.get(key) or 0.0)


@dataclass
class Launch:
    index: int
    launch_id: str
    kind: str  # start | resume | assumed (no history)
    start: float  # unix time
    start_step: int
    event: dict
    end: float = 0.0
    end_event: dict | None = None
    ended: str = ""
    last_step: int = 0
    step_time_s: float = 0.0  # scaled step time of all its records, kept and discarded
    eval_s: float = 0.0  # time_eval_s of all its records (eval time is not step time)
    kept_steps: int = 0
    discarded_steps: int = 0

    @property
    def wall_s(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def startup_teardown_s(self) -> float:
        return self.wall_s - self.step_time_s - self.eval_s

    @property
    def slurm(self) -> str:
        job = self.event.get("slurm_job_id")
        if not job:
            return ""
        restart = self.event.get("slurm_restart_count")
        return f"{job}" + (f" (restart {restart})" if restart not in (None, "") else "")


@dataclass
class Accounting:
    total_wall_s: float
    productive_s: float
    startup_teardown_s: float
    eval_s: float
    recomputed_s: float
    checkpoint_s: float
    data_wait_s: float
    other_s: float
    between_launches_s: float
    queued_first_s: float | None  # from the first submission in jobs.jsonl to the first launch, when known

    @property
    def goodput(self) -> float | None:
        return self.productive_s / self.total_wall_s if self.total_wall_s > 0 else None

    def rows(self) -> list[tuple[str, float]]:
        """(what, seconds): productive, then each kind of lost time; they add up to total_wall_s."""
        return [
            ("productive (compute, communication, optimizer, sync)", self.productive_s),
            ("start-up + teardown", self.startup_teardown_s),
            ("evaluation", self.eval_s),
            ("recomputed steps", self.recomputed_s),
            ("checkpoint stalls", self.checkpoint_s),
            ("data wait", self.data_wait_s),
            ("other", self.other_s),
        ]


@dataclass
class Stragglers:
    checks: int = 0  # records with rank_step_time_s
    flagged_checks: int = 0  # of them, with at least one straggler
    detections: int = 0
    by_rank: dict[int, dict] = field(default_factory=dict)  # rank -> host, node, count, worst_ratio
    worst: dict | None = None  # the detection with the highest ratio, plus its step


@dataclass
class RunLog:
    rundir: RunDir
    kept: list[Step]
    discarded: list[Step]
    launches: list[Launch]
    accounting: Accounting
    stragglers: Stragglers
    summary: dict | None
    t0: float  # the first launch's start: time zero of the report's time axes

    @property
    def restarts(self) -> int:
        return max(0, len(self.launches) - 1)

    @property
    def tokens_seen(self) -> object:
        """The trained model's tokens (the recipe's units): summary.json's, else the newest kept record's (as
        written: None where neither has it)."""
        counted = [s.raw["tokens_seen"] for s in sorted(self.kept, key=lambda s: s.step) if "tokens_seen" in s.raw]
        return (self.summary or {}).get("tokens_seen", counted[-1] if counted else None)


def _signal_name(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return signal.Signals(value).name
        except ValueError:
            return f"signal {value}"
    return str(value) if value else "signal"


def _pick(launches: list[Launch], launch_id: object, t: float | None) -> Launch | None:
    """The launch a record or end event belongs to: by unique launch id, else the latest started by time t."""
    pool = launches
    if isinstance(launch_id, str) and launch_id:
        same = [x for x in launches if x.launch_id == launch_id]
        if len(same) == 1:
            return same[0]
        pool = same or launches
    if not pool:
        return None
    if t is None:
        return pool[-1]
    started = [x for x in pool if x.start <= t]
    return started[-1] if started else pool[0]


def _launches(history: list[dict]) -> list[Launch]:
    starts = [e for e in history if e.get("event") in START_EVENTS and number(e, "time") is not None]
    starts.sort(key=lambda e: number(e, "process_start") or number(e, "time"))
    launches = []
    for i, e in enumerate(starts):
        step = e.get("step")
        launches.append(
            Launch(
                index=i,
                launch_id=str(e.get("launch") or ""),
                kind=e["event"],
                start=number(e, "process_start") or number(e, "time"),
                start_step=step if isinstance(step, int) else 0,
                event=e,
            )
        )
    for e in history:
        if e.get("event") in END_EVENTS and number(e, "time") is not None:
            launch = _pick(launches, e.get("launch"), number(e, "time"))
            if launch is not None and (launch.end_event is None or e["time"] >= launch.end_event["time"]):
                launch.end_event = e
    return launches


def _assign_gaps(steps: list[Step], base: int) -> None:
    prev = base
    for s in sorted(steps, key=lambda s: s.step):
        s.gap = max(1, s.step - prev)
        prev = s.step


def _ending(launch: Launch, is_last: bool) -> str:
    e = launch.end_event
    if e is None:
        return "no end event (running, or killed)" if is_last else "killed (no end event)"
    if e["event"] == EVENT_STOPPED:
        return f"stopped ({_signal_name(e.get('signal'))})"
    if e["event"] == EVENT_HANG:
        message = " ".join(str(e.get("message") or "").split())
        return f"hang: {message[:100]}" if message else "hang"
    return "done"


def _stragglers(steps: list[Step]) -> Stragglers:
    out = Stragglers()
    for s in sorted(steps, key=lambda s: (s.step, s.kept)):
        if isinstance(s.raw.get("rank_step_time_s"), list):
            out.checks += 1
        found = [x for x in s.raw.get("stragglers") or [] if isinstance(x, dict) and isinstance(x.get("rank"), int)]
        out.flagged_checks += bool(found)
        for x in found:
            out.detections += 1
            ratio = number(x, "ratio")
            rank = out.by_rank.setdefault(
                x["rank"], {"host": x.get("host", ""), "node": x.get("node", ""), "count": 0, "worst_ratio": None}
            )
            rank["count"] += 1
            if ratio is not None and (rank["worst_ratio"] is None or ratio > rank["worst_ratio"]):
                rank["worst_ratio"] = ratio
            if ratio is not None and (out.worst is None or ratio > out.worst["ratio"]):
                out.worst = {**x, "ratio": ratio, "step": s.step}
    return out


def _first_submission(rundir: RunDir) -> float | None:
    times = [t for t in (number(j, "time") for j in read_jsonl(rundir.jobs)) if t is not None]
    return min(times) if times else None


def analyze(rundir: RunDir) -> RunLog:
    """Read a run directory's metrics and history (OSError for unreadable files, as raised by the reads)."""
    kept = [Step(r, True) for r in read_jsonl(rundir.metrics) if isinstance(r.get("step"), int)]
    discarded = [Step(r, False) for r in read_jsonl(rundir.metrics_discarded) if isinstance(r.get("step"), int)]
    every = kept + discarded
    launches = _place_steps(_launches(read_jsonl(rundir.history)), every)
    for i, launch in enumerate(launches):
        _close_launch(launch, [s for s in every if s.launch == launch.index], is_last=i == len(launches) - 1)
    t0 = launches[0].start if launches else min((s.time for s in every if s.time is not None), default=0.0)
    return RunLog(
        rundir=rundir,
        kept=kept,
        discarded=discarded,
        launches=launches,
        accounting=_accounting(rundir, launches, kept, discarded),
        stragglers=_stragglers(every),
        summary=_summary(rundir),
        t0=t0,
    )


def _place_steps(launches: list[Launch], every: list[Step]) -> list[Launch]:
    """Each record's launch and the steps it stands for; without a history, one launch from step 0 assumed."""
    assumed = not launches and bool(every)
    if assumed:  # no history: one launch from step 0; its start is fixed below, once the gaps are known
        first_id = next((r.raw.get("launch") for r in every if r.raw.get("launch")), "")
        launches = [Launch(0, str(first_id or ""), "assumed", start=-math.inf, start_step=0, event={})]
    for s in every:
        launch = _pick(launches, s.raw.get("launch"), s.time)
        s.launch = launch.index if launch is not None else None
    timed = [s for s in every if s.get("step_time_s") is not None]
    for launch in launches:
        _assign_gaps([s for s in timed if s.launch == launch.index], launch.start_step)
    _assign_gaps([s for s in timed if s.launch is None], 0)
    if assumed:
        first = min(every, key=lambda s: (s.step, s.time or math.inf))
        times = [s.time for s in every if s.time is not None]
        launches[0].start = (min(times) - first.scaled("step_time_s")) if times else 0.0
    return launches


def _close_launch(launch: Launch, mine: list[Step], is_last: bool) -> None:
    """A launch's end, last step and time totals from its own records."""
    times = [s.time for s in mine if s.time is not None]
    if launch.end_event is not None:
        launch.end = launch.end_event["time"]
    else:
        launch.end = max(times) if times else launch.start
    end_step = (launch.end_event or {}).get("step")
    launch.last_step = end_step if isinstance(end_step, int) else max([s.step for s in mine], default=launch.start_step)
    launch.step_time_s = sum(s.scaled("step_time_s") for s in mine)
    launch.eval_s = sum(s.get("time_eval_s") or 0.0 for s in mine)
    launch.kept_steps = sum(s.gap for s in mine if s.kept and s.get("step_time_s") is not None)
    launch.discarded_steps = sum(s.gap for s in mine if not s.kept and s.get("step_time_s") is not None)
    launch.ended = _ending(launch, is_last=is_last)


def _accounting(rundir: RunDir, launches: list[Launch], kept: list[Step], discarded: list[Step]) -> Accounting:
    """Where the run's wall time went, launch by launch summed."""
    total = sum(x.wall_s for x in launches)
    productive = sum(s.scaled("step_time_s") - s.scaled("time_ckpt_s") - s.scaled("time_data_s") for s in kept)
    startup = sum(x.startup_teardown_s for x in launches)
    evaluation = sum(x.eval_s for x in launches)
    recomputed = sum(s.scaled("step_time_s") for s in discarded)
    ckpt = sum(s.scaled("time_ckpt_s") for s in kept)
    data = sum(s.scaled("time_data_s") for s in kept)
    submitted = _first_submission(rundir)
    return Accounting(
        total_wall_s=total,
        productive_s=productive,
        startup_teardown_s=startup,
        eval_s=evaluation,
        recomputed_s=recomputed,
        checkpoint_s=ckpt,
        data_wait_s=data,
        other_s=total - (productive + startup + evaluation + recomputed + ckpt + data),
        between_launches_s=sum(max(0.0, b.start - a.end) for a, b in pairwise(launches)),
        queued_first_s=max(0.0, launches[0].start - submitted) if launches and submitted is not None else None,
    )


def config_dict(rundir: RunDir) -> dict:
    """config.yaml as a plain dict, {} when missing or unparsable: the reports read a few keys of it leniently (a run
    submitted by an older version need not pass today's checks)."""
    import yaml

    try:
        cfg = yaml.safe_load(rundir.config.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _summary(rundir: RunDir) -> dict | None:
    """summary.json; None when missing or unparsable (it is written atomically: a torn one is not trusted)."""
    try:
        summary = json.loads(rundir.summary.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None
