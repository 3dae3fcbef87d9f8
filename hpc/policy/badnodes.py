"""Nodes a failure pointed at, recorded in the run's history with the evidence; no later launch of the run uses
them until they are taken back (torch-free).

A node is named bad when the trainer's diagnosis in failure.json points at its ranks (the rank that went away or
hung first: ``suspects``), when Slurm declared it failed, when the gang preflight found it far below its peers, or
when the straggler monitor named it too often in a row. Each becomes one ``bad_node`` history event; the set of bad
nodes of a run is read back from the history, so every launcher (the local one, the Slurm driver, the sbatch
scripts, ``hpc resume``) sees the same list.

A bad node is taken back by a ``node_back`` event: by hand (``hpc unexclude RUN NODE``), or by a launcher once
``job.retake_nodes_after_s`` have passed since it was named (``take_back_due``), and never while its verdict stands:
while the scheduler still holds it down or drained. A node taken back rejoins at the run's next launch (an in-job
restart or a new job), where the gang preflight checks it again; failing it, it is named bad again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rundir.contract import EVENT_BAD_NODE, EVENT_NODE_BACK, append_event
from rundir.paths import RunDir, read_jsonl


def bad_node_events(rundir: RunDir) -> list[dict]:
    """The ``bad_node`` events of the nodes that are bad now (not taken back since)."""
    current: dict[str, dict] = {}
    for e in read_jsonl(rundir.history):
        node = str(e.get("node") or "")
        if e.get("event") == EVENT_BAD_NODE and node and node not in current:
            current[node] = e
        elif e.get("event") == EVENT_NODE_BACK and node:
            current.pop(node, None)
    return list(current.values())


def node_changes(rundir: RunDir) -> list[dict]:
    """Every ``bad_node`` and ``node_back`` event of the run, in order (the report's record of them)."""
    return [e for e in read_jsonl(rundir.history) if e.get("event") in (EVENT_BAD_NODE, EVENT_NODE_BACK)]


def bad_nodes(rundir: RunDir) -> list[str]:
    """Names of the run's bad nodes, in the order they were named, each once; taken-back nodes are not."""
    return [str(e["node"]) for e in bad_node_events(rundir)]


def take_back(rundir: RunDir, node: str, *, how: str, **extra) -> None:
    """One ``node_back`` event: the next launch may use ``node`` again."""
    append_event(rundir.history, EVENT_NODE_BACK, node=node, how=how, **extra)


#: held(nodes) -> {node: the scheduler's verdict} for the nodes it still holds down or drained
Held = Callable[[list[str]], dict[str, str]]


def retake_how(after_s: float) -> str:
    return f"after job.retake_nodes_after_s={after_s:g}"


def due_back(rundir: RunDir, after_s: float, held: Held | None = None, now: float | None = None) -> dict[str, float]:
    """node -> seconds since it was named, for the bad nodes named at least ``after_s`` seconds ago (0: never) that
    the scheduler does not hold down or drained (``held``; None: no scheduler, as locally). Reads only."""
    if not after_s:
        return {}
    now = time.time() if now is None else now
    ages = {str(e["node"]): now - float(e.get("time", now)) for e in bad_node_events(rundir)}
    due = {node: age for node, age in ages.items() if age >= after_s}
    verdicts = held(list(due)) if held and due else {}
    return {node: age for node, age in due.items() if node not in verdicts}


def take_back_due(rundir: RunDir, after_s: float, held: Held | None = None, now: float | None = None) -> list[str]:
    """``due_back``'s nodes taken back (a ``node_back`` event each, before a launch chooses its nodes)."""
    back = due_back(rundir, after_s, held, now)
    for node, age in back.items():
        take_back(rundir, node, how=retake_how(after_s), named_s_ago=round(age, 1))
    return list(back)


def suspects_of(failure: dict) -> list[dict]:
    """The well-formed suspects of a failure record (``RunDir.write_failure``)."""
    out = []
    for s in failure.get("suspects") or []:
        if isinstance(s, dict) and isinstance(s.get("node"), str) and s["node"]:
            out.append(s)
    return out


def usable_nodes(rundir: RunDir, allocation: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The allocation's nodes that the run has not named bad, in order (the history read once, not per node)."""
    bad = set(bad_nodes(rundir))
    return tuple(n for n in allocation if n not in bad)


def recorded(rundir: RunDir) -> set[tuple[str, str]]:
    """(node, launch) of every ``bad_node`` event so far."""
    return {(str(e.get("node")), str(e.get("launch"))) for e in bad_node_events(rundir)}


def record_bad_node(
    rundir: RunDir, node: str, *, reason: str, evidence: str, launch: str, known: set | None = None, **extra
) -> None:
    """One ``bad_node`` event (once per node and launch: several suspects on one node make one event). ``known``:
    ``recorded(rundir)``, read once by a caller that records many nodes (updated here)."""
    known = recorded(rundir) if known is None else known
    if (node, launch) in known:
        return
    known.add((node, launch))
    append_event(rundir.history, EVENT_BAD_NODE, node=node, reason=reason, evidence=evidence, launch=launch, **extra)
