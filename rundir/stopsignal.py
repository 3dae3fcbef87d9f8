"""The stop signal's path to the ranks and what a stop costs, defined once (torch-free).

The trainer records these, ``python -m hpc status`` and ``report`` warn from them, and ``python -m hpc selftest``
checks them on the cluster:

- **How a signal reaches a rank** (``rank_record``, made by every rank at start, a node's in
  ``logs/signal_node_NNNNN.json``): its process chain up to slurmstepd (else up to the launcher or init), each
  process with its command line and the stop signals it blocks, ignores or catches. Slurm delivers a step's signal
  to every process of the step, so a wrapper between slurmstepd and the rank swallows it by blocking it (the rank
  inherits the blocked mask and never sees it) or by running the rank outside the step's processes; the chain names
  that wrapper.
- **A stop's figures**, in the ``stopped`` history event: ``stop_s`` (the first rank's receipt of the signal ->
  every rank agreed to stop at a step boundary), ``save_s`` (the final checkpoint, save -> commit),
  ``signal_to_commit_s`` (receipt -> committed), ``received`` (signal name -> the ranks that received it
  themselves) and ``learned`` (the ranks that got no signal and stopped because the others agreed to).
- **The lead-time rule** (``LeadBudget``): ``job.signal_lead_s`` must cover a stop with margin,
  lead >= SAFETY_FACTOR x (stop + save). Measured at a stop, or estimated without one from the step time and the
  newest checkpoint's save time (rank 0 writes ``stop_budget.json`` once per launch, and again when a later save
  makes the lead too short).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rundir.contract import EVENT_STOPPED
from rundir.paths import RunDir, read_jsonl

#: job.signal_lead_s must be at least this many times a stop's cost (signal -> committed checkpoint). Two, because
#: the cost varies from stop to stop: the signal can land just after a step boundary (a whole step to wait), a
#: shared file system's write time has a long tail, and the estimate without a stop sees one step and one save.
SAFETY_FACTOR = 2.0
#: The process that starts a Slurm step's tasks: a rank's process chain is recorded up to it.
STEPD = "slurmstepd"
MAX_CHAIN = 12  # processes looked at, from the rank up, for slurmstepd
LOCAL_CHAIN = 3  # kept of a chain without slurmstepd (a local launch): the rank, its parent and grandparent
MAX_WORDS = 24  # words of a command line kept in the record, each at most MAX_WORD_CHARS
MAX_WORD_CHARS = 200
_MASKS = (("blocked", "SigBlk"), ("ignored", "SigIgn"), ("caught", "SigCgt"))


def signal_state(status_text: str, names: Iterable[str]) -> dict[str, list[str]]:
    """Which of the signals ``names`` a process blocks, ignores and catches, from its /proc/PID/status text."""
    masks = {}
    for line in status_text.splitlines():
        key, _, value = line.partition(":")
        if key in ("SigBlk", "SigIgn", "SigCgt"):
            masks[key] = int(value.strip() or "0", 16)
    numbers = {name: signal.Signals[name].value for name in names}
    return {
        label: [name for name, number in numbers.items() if masks.get(key, 0) >> (number - 1) & 1]
        for label, key in _MASKS
    }


def _process(pid: int, names: list[str], proc: Path) -> tuple[dict, int] | None:
    """One process of a chain, and its parent's pid; None when it is gone or unreadable."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        raw = (proc / str(pid) / "cmdline").read_bytes()
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    # "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses, so split at the last ")"
    name = stat[stat.find("(") + 1 : stat.rfind(")")]
    ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
    words = [w.decode(errors="replace")[:MAX_WORD_CHARS] for w in raw.split(b"\0") if w]
    return {"pid": pid, "name": name, "cmdline": words[:MAX_WORDS], **signal_state(status, names)}, ppid


def process_chain(names: Iterable[str], pid: int | None = None, proc: Path = Path("/proc")) -> list[dict]:
    """Process ``pid`` (default: this one) and its ancestors, nearest first, up to and with slurmstepd: each
    ``{pid, name, cmdline, blocked, ignored, caught}``, the last three being which of the signals ``names`` it
    blocks, ignores and catches. Without slurmstepd among the MAX_CHAIN nearest (a local launch), the first
    LOCAL_CHAIN only: the command lines of whatever started the launcher are none of the run's business.
    [] where /proc cannot be read."""
    names = list(names)
    pid = os.getpid() if pid is None else pid
    chain: list[dict] = []
    while pid > 0 and len(chain) < MAX_CHAIN:
        found = _process(pid, names, proc)
        if found is None:
            break
        entry, pid = found
        chain.append(entry)
        if entry["name"] == STEPD:
            return chain
    return chain[:LOCAL_CHAIN]


def wrappers(chain: list[dict]) -> list[dict]:
    """The processes between a rank (the chain's first entry) and slurmstepd; [] without slurmstepd in the chain
    (a local launch: everything up to init would count)."""
    names = [p.get("name") for p in chain]
    return chain[1 : names.index(STEPD)] if STEPD in names else []


def describe_process(entry: dict, signame: str | None = None, *, pid: bool = True) -> str:
    """``pid 123 `cmd args` (blocks SIGUSR2)`` for a report line (without "pid 123" for ``pid=False``)."""
    words = entry.get("cmdline") or [f"[{entry.get('name', '?')}]"]
    text = " ".join(" ".join(words).split())  # one line
    text = text if len(text) <= 160 else text[:157] + "..."
    notes = [
        f"{verb} {signame}"
        for verb, key in (("blocks", "blocked"), ("ignores", "ignored"))
        if signame and signame in entry.get(key, [])
    ]
    return (f"pid {entry.get('pid')} " if pid else "") + f"`{text}`" + (f" ({', '.join(notes)})" if notes else "")


def signal_name(number: int | None) -> str | None:
    if not number:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class LeadBudget:
    """Whether ``job.signal_lead_s`` covers a stop: lead >= factor x needed."""

    lead_s: float  # job.signal_lead_s
    needed_s: float  # a stop's cost: measured (signal -> committed checkpoint), or estimated (a step + a save)
    measured: bool  # True: from a real stop; False: estimated from a step time and a checkpoint's save time
    factor: float = SAFETY_FACTOR

    @property
    def ok(self) -> bool:
        return self.lead_s >= self.factor * self.needed_s

    @property
    def covered(self) -> bool:
        """The lead covers the cost itself, if not with the margin."""
        return self.lead_s >= self.needed_s

    @property
    def required_s(self) -> int:
        """The smallest lead (whole seconds) that passes."""
        return max(10, -int(-self.factor * self.needed_s // 1))

    def describe(self) -> str:
        cost = (
            f"a stop took {self.needed_s:.1f} s from the signal to the committed checkpoint"
            if self.measured
            else f"a stop would take about {self.needed_s:.1f} s (a step and the newest checkpoint's save)"
        )
        if self.ok:
            return (
                f"job.signal_lead_s={self.lead_s:g} covers a stop with margin: {cost} (x{self.factor:g} needs "
                f"{self.factor * self.needed_s:.1f} s)"
            )
        margin = "covers it, but not with the margin of" if self.covered else "is shorter than that, let alone"
        return (
            f"job.signal_lead_s={self.lead_s:g} is too short: {cost}; the lead {margin} x{self.factor:g}. Raise "
            f"job.signal_lead_s to at least {self.required_s}, or the time limit may kill the job before its "
            "checkpoint is committed"
        )

    def fields(self) -> dict:
        return {"lead_s": self.lead_s, "needed_s": round(self.needed_s, 3), "measured": self.measured, "ok": self.ok}


def estimate(lead_s: float, step_s: float, save_s: float) -> LeadBudget:
    """A stop's cost without a stop: the signal may land at the start of a step (a whole step to wait for the
    boundary), then the final checkpoint is saved."""
    return LeadBudget(lead_s=lead_s, needed_s=step_s + save_s, measured=False)


def newest_budget(rundir: RunDir, lead_s: float | None = None) -> LeadBudget | None:
    """The newest figure of a stop's cost in the run directory (a stopped event's measurement or rank 0's
    estimate, whichever is newer) against ``lead_s`` (default: the lead recorded with the figure); None when there
    is none yet."""
    found: list[tuple[float, float, float, bool]] = []  # (time, needed, lead, measured)
    for e in read_jsonl(rundir.history):
        needed, lead = e.get("signal_to_commit_s"), e.get("lead_s")
        if e.get("event") == EVENT_STOPPED and _number(needed) and _number(lead) and _number(e.get("time")):
            found.append((e["time"], needed, lead, True))
    try:
        b = json.loads(rundir.stop_budget.read_text())
    except (OSError, ValueError):
        b = None
    if isinstance(b, dict) and all(_number(b.get(k)) for k in ("time", "needed_s", "lead_s")):
        found.append((b["time"], b["needed_s"], b["lead_s"], bool(b.get("measured"))))
    if not found:
        return None
    _, needed, lead, measured = max(found, key=lambda x: x[0])
    return LeadBudget(lead_s=float(lead if lead_s is None else lead_s), needed_s=float(needed), measured=measured)


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
