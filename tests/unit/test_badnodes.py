"""A run's bad nodes as its history records them (hpc/policy/badnodes.py): named, taken back, named again."""

import json

import pytest

from hpc.policy.badnodes import bad_nodes, node_changes, record_bad_node, take_back, take_back_due
from rundir import RunDir
from rundir.paths import read_jsonl


@pytest.fixture
def rundir(tmp_path):
    rundir = RunDir(tmp_path / "run")
    rundir.create()
    return rundir


def name(rundir, node, launch="L0"):
    record_bad_node(rundir, node, reason="crash", evidence="its rank went away first", launch=launch)


def set_time(rundir, node, t):
    """Rewrite the time of ``node``'s bad_node events (a test cannot wait an hour)."""
    lines = []
    for e in read_jsonl(rundir.history):
        if e.get("event") == "bad_node" and e.get("node") == node:
            e["time"] = t
        lines.append(json.dumps(e))
    rundir.history.write_text("\n".join(lines) + "\n")


def test_a_node_taken_back_is_no_longer_bad_and_can_be_named_again(rundir):
    name(rundir, "n1")
    name(rundir, "n2")
    name(rundir, "n1")  # the same launch names a node once
    assert bad_nodes(rundir) == ["n1", "n2"]
    take_back(rundir, "n1", how="by hand")
    assert bad_nodes(rundir) == ["n2"]
    name(rundir, "n1", launch="L1")
    assert bad_nodes(rundir) == ["n2", "n1"]
    assert [(e["event"], e["node"]) for e in node_changes(rundir)] == [
        ("bad_node", "n1"),
        ("bad_node", "n2"),
        ("node_back", "n1"),
        ("bad_node", "n1"),
    ]


def test_nodes_are_taken_back_after_the_configured_time_unless_the_scheduler_holds_them(rundir):
    name(rundir, "n1")
    name(rundir, "n2")
    name(rundir, "n3")
    set_time(rundir, "n1", 1000.0)
    set_time(rundir, "n2", 1000.0)
    set_time(rundir, "n3", 1500.0)
    assert take_back_due(rundir, 0, now=10_000.0) == []  # 0: never
    assert take_back_due(rundir, 600, now=1400.0) == []  # not yet
    asked = []

    def held(nodes):
        asked.append(list(nodes))
        return {"n2": "DOWN (Not responding)"}

    assert take_back_due(rundir, 600, held, now=1700.0) == ["n1"]
    assert asked == [["n1", "n2"]]
    assert bad_nodes(rundir) == ["n2", "n3"]
    back = [e for e in read_jsonl(rundir.history) if e["event"] == "node_back"]
    assert back[0]["how"] == "after job.retake_nodes_after_s=600" and back[0]["named_s_ago"] == 700.0
    # once Slurm lets n2 go it is taken back; n3's time has come too
    assert take_back_due(rundir, 600, lambda nodes: {}, now=2200.0) == ["n2", "n3"]
    assert bad_nodes(rundir) == []
