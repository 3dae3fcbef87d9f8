"""The gang preflight with real processes (2 simulated nodes x 2 ranks): its history event on a healthy launch, a
slow link named (monitor.preflight: warn, training goes on) and the launch ended for it (exclude), each after the
second measurement that a first verdict naming a node makes every rank take.

A slow link is injected with HPC_INJECT=slowlink:RANK:SECONDS (trainer/observe/inject.py): that rank waits before
each of its preflight collectives. Rank 2 is on node 1: node 1's intra-node all-reduce is the slow one.
"""

import json
import os
import subprocess

import pytest

from rundir.contract import EVENT_PREFLIGHT, EVENT_START, EXIT_FAILED, FAILURE_PREFLIGHT, INJECT_VAR
from tests.conftest import PY, ROOT, history

pytestmark = pytest.mark.mp
SLOW_LINK = "slowlink:2:0.05"  # 50 ms per collective: 1 MiB..4 MiB take ~1-4 ms here


def launch(run_dir, small_dataset, *sets, inject="") -> subprocess.CompletedProcess:
    args = [PY, "-m", "hpc.submit", "tiny", "--local", "--run-dir", str(run_dir)]
    for s in (
        f"data.path={small_dataset}", "train.steps=2", "train.warmup_steps=1", "train.eval_every=0",
        "model.d_model=64", "model.n_layers=2", "model.seq_len=64", "checkpoint.every_steps=0",
        "checkpoint.at_end=false", "monitor.tensorboard=false", *sets,
    ):  # fmt: skip
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT), INJECT_VAR: inject}
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def preflight_event(run_dir) -> dict:
    (event,) = [e for e in history(run_dir) if e["event"] == EVENT_PREFLIGHT]
    return event


def test_a_healthy_launch_records_every_nodes_figures_and_names_nobody(tmp_path, small_dataset):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, small_dataset)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    event = preflight_event(run_dir)
    assert event["named"] == [] and event["action"] is None and event["mode"] == "warn"
    assert [(n["node"], n["ranks"]) for n in event["nodes"]] == [(0, [0, 1]), (1, [2, 3])]
    for node in event["nodes"]:
        for key in ("compute_gflops", "mem_free_gb", "intra_gbps", "intra_latency_us", "inter_gbps",
                    "inter_latency_us", "data_read_s"):  # fmt: skip
            assert node[key] > 0, (key, node)
        assert node["device"].startswith("cpu") and node["link_gbps"] is None  # two nodes: no ring ping-pong
    assert any("two nodes" in s for s in event["skipped"])
    assert 0 < event["seconds"] < 2, event["seconds"]  # the cost on the tiny example
    start = [e for e in history(run_dir) if e["event"] == EVENT_START][0]
    assert start["startup_s"]["preflight"] == pytest.approx(event["seconds"], abs=0.05)
    assert "preflight node 1 (" in (run_dir / "logs" / "rank_00000.log").read_text()


def test_a_slow_link_is_named_and_training_goes_on_with_warn(tmp_path, small_dataset):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, small_dataset, inject=SLOW_LINK)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    event = preflight_event(run_dir)
    assert [n["node"] for n in event["named"]] == [1] and event["action"] == "warn"
    assert event["measured"] == 2  # named only after a second measurement said so too
    assert "intra-node all-reduce bandwidth" in event["named"][0]["why"]
    assert event["nodes"][1]["intra_gbps"] < 0.5 * event["nodes"][0]["intra_gbps"]
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 2
    assert "preflight: node 1 (" in (run_dir / "logs" / "rank_00000.log").read_text()


def test_exclude_ends_the_launch_with_the_node_as_suspect(tmp_path, small_dataset):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, small_dataset, "monitor.preflight=exclude", "job.max_failures=0", inject=SLOW_LINK)
    assert proc.returncode == EXIT_FAILED, proc.stdout + proc.stderr
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["kind"] == FAILURE_PREFLIGHT and failure["rank"] == 0
    assert "node 1 (" in failure["message"] and "intra-node all-reduce bandwidth" in failure["message"]
    assert [(s["rank"], s["node_index"]) for s in failure["suspects"]] == [(2, 1), (3, 1)]
    assert preflight_event(run_dir)["action"] == "exclude" and preflight_event(run_dir)["measured"] == 2
    assert not any(e["event"] == EVENT_START for e in history(run_dir))  # ended before step 0
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
