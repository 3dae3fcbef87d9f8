"""What Slurm says of nodes (scontrol), for the launchers' bad-node bookkeeping (torch-free)."""

from __future__ import annotations

import re
import shutil
import subprocess

#: node states (scontrol's State=, '+'-separated) in which Slurm holds a node failed
FAILED_STATES = {"DOWN", "FAIL", "FAILING", "NOT_RESPONDING"}
#: ... or taken out of service by an operator
DRAINED_STATES = {"DRAIN", "DRAINED", "DRAINING", "MAINTENANCE", "REBOOT_REQUESTED", "REBOOT_ISSUED"}


def node_states(nodes: list[str]) -> dict[str, tuple[set[str], str]]:
    """node -> (its state flags, Slurm's reason) from scontrol; nodes it does not answer for are left out."""
    if not nodes or shutil.which("scontrol") is None:
        return {}
    out = subprocess.run(["scontrol", "-o", "show", "node", ",".join(nodes)], capture_output=True, text=True)
    states = {}
    for line in out.stdout.splitlines():
        name = re.search(r"\bNodeName=(\S+)", line)
        state = re.search(r"\bState=(\S+)", line)
        reason = re.search(r"\bReason=(.*?)(?= \w+=|$)", line)
        if name and state:
            states[name.group(1)] = (set(state.group(1).split("+")), reason.group(1).strip() if reason else "")
    return states


def describe(state: set[str], reason: str) -> str:
    return f"{'+'.join(sorted(state))} ({reason or 'no reason given'})"


def held_by_slurm(nodes: list[str]) -> dict[str, str]:
    """The nodes Slurm still holds down or drained, with its verdict (a bad node is not taken back while it
    stands). Without scontrol, or for nodes Slurm does not know (simulated ones), nothing."""
    return {
        node: describe(state, reason)
        for node, (state, reason) in node_states(nodes).items()
        if state & (FAILED_STATES | DRAINED_STATES)
    }
