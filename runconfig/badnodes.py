"""Nodes a failure pointed at, recorded in the run's history with the evidence; no later launch of the run uses
them (torch-free).

A node is named bad when the trainer's diagnosis in failure.json points at its ranks (the rank that went away or
hung first: ``suspects``), when the gang preflight found it far below its peers, or when the straggler monitor
named it too often in a row. Each becomes one ``bad_node`` history event; the set of bad nodes of a run is read
back from the history, so every launcher (the local one, the Slurm driver, the sbatch scripts, ``hpc resume``)
sees the same list.
"""

from __future__ import annotations

from runconfig.contract import EVENT_BAD_NODE, append_event
from runconfig.rundir import RunDir, read_jsonl


def bad_node_events(rundir: RunDir) -> list[dict]:
    return [e for e in read_jsonl(rundir.history) if e.get("event") == EVENT_BAD_NODE]


def bad_nodes(rundir: RunDir) -> list[str]:
    """Names of the run's bad nodes, in the order they were named, each once."""
    return list(dict.fromkeys(str(e["node"]) for e in bad_node_events(rundir) if e.get("node")))


def suspects_of(failure: dict) -> list[dict]:
    """The well-formed suspects of a failure record (``RunDir.write_failure``)."""
    out = []
    for s in failure.get("suspects") or []:
        if isinstance(s, dict) and isinstance(s.get("node"), str) and s["node"]:
            out.append(s)
    return out


def record_bad_node(rundir: RunDir, node: str, *, reason: str, evidence: str, launch: str, **extra) -> None:
    """One ``bad_node`` event (once per node and launch: several suspects on one node make one event)."""
    for e in bad_node_events(rundir):
        if e.get("node") == node and e.get("launch") == launch:
            return
    append_event(rundir.history, EVENT_BAD_NODE, node=node, reason=reason, evidence=evidence, launch=launch, **extra)
