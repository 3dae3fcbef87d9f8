"""Live metrics scraped by a real Prometheus (Debian's, started by envs/prometheus/server.sh): a run of 2 simulated
nodes x 2 ranks serves an endpoint per node, announced in its file_sd target file, and pushes to a real Pushgateway;
with the hang watchdog off, heartbeats still reach the metrics."""

import json
import os
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from rundir.paths import read_jsonl
from tests.conftest import ROOT
from tests.mp.test_checkpoint import common, start

pytestmark = pytest.mark.mp

PORT, GATEWAY_PORT = 19410, 19411  # not envs/prometheus/server.sh's defaults: a developer's own may be running


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    base = tmp_path_factory.mktemp("live")
    state, runs = base / "prometheus", base / "runs"
    env = {
        **os.environ,
        "HPC_PROMETHEUS_PORT": str(PORT),
        "HPC_PUSHGATEWAY_PORT": str(GATEWAY_PORT),
        "HPC_PROMETHEUS_TARGETS": f"{runs}/prometheus/*.json",
        "HPC_PROMETHEUS_SCRAPE": "500ms",
    }
    script = [str(ROOT / "envs/prometheus/server.sh")]
    try:
        subprocess.run(["bash", *script, "start", str(state)], env=env, check=True, timeout=120)
        yield runs
    finally:
        subprocess.run(["bash", *script, "wipe", str(state)], env=env, timeout=60)


def query(expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{PORT}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)["data"]["result"]


DASHBOARD = ROOT / "envs" / "grafana" / "hpc-trainer-live.json"
GPU_ONLY = {"MFU (GPU)", "Device memory by rank (GPU)"}  # their series exist on GPU runs only


def assert_dashboard_queries_return_series(proc) -> None:
    """Every panel query of the shipped Grafana dashboard, its $run the test's run, returns series from the real
    Prometheus while the run trains (once its first evaluation, step 8, is scraped)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = {p["title"]: t["expr"] for p in dashboard["panels"] for t in p["targets"]}
    assert len(exprs) == len(dashboard["panels"]) >= 12 and all("$run" in e for e in exprs.values())
    [runs] = [v for v in dashboard["templating"]["list"] if v["name"] == "run"]
    assert runs["query"]["query"] == "label_values(hpc_step, run)"  # Grafana's: the run label of hpc_step
    deadline, empty = time.monotonic() + 60, None
    while time.monotonic() < deadline and proc.poll() is None:
        live = {e["metric"].get("run") for e in query("hpc_step")}
        empty = [t for t, e in exprs.items() if t not in GPU_ONLY and not query(e.replace("$run", "live"))]
        if "live" in live and not empty:
            return
        time.sleep(0.5)
    raise AssertionError(f"dashboard panels with no series: {empty}")


def test_a_real_prometheus_scrapes_every_node_and_the_gateway_keeps_the_end(prometheus, small_dataset):
    run_dir = prometheus / "live"
    sets = [
        *common(small_dataset), "train.steps=40", "checkpoint.every_steps=20", "train.log_every=1",
        "live.serve=true", f"live.pushgateway=http://127.0.0.1:{GATEWAY_PORT}", "live.push_every_s=0.5",
        "monitor.hang_timeout_s=0", "monitor.heartbeat_s=0.5",
    ]  # fmt: skip
    proc = start(run_dir, sets, inject="slow:0:0.25")  # ~10 s of steps: long enough to be scraped
    target_file = prometheus / "prometheus" / "live.json"
    try:
        seen: dict = {}
        steps: list = []
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None:
            # scraped from the endpoints (an instance label of host:port), not from the gateway; heartbeats come
            # from start-up on, a step only once the first record is written
            beats = query('hpc_heartbeat_age_seconds{run="live",job="hpc-trainer",instance!=""}')
            seen = {(b["metric"]["node"], b["metric"]["rank"]): b["metric"]["instance"] for b in beats}
            steps = query('hpc_step{run="live",instance!=""}')
            if len(seen) == 4 and len(steps) == 2:
                break
            time.sleep(0.5)
        assert proc.poll() is None, f"the run ended before Prometheus scraped all of it: {seen} {steps}"
        assert sorted(seen) == [("node0", "0"), ("node0", "1"), ("node1", "2"), ("node1", "3")]
        instances = {seen[("node0", "0")], seen[("node1", "2")]}
        assert len(instances) == 2 and seen[("node0", "1")] == seen[("node0", "0")]  # one endpoint per node
        targets = json.loads(target_file.read_text())[0]["targets"]
        assert sorted(targets) == sorted(instances)  # what the file announced is what Prometheus scraped
        assert {s["metric"]["node"] for s in steps} == {"node0", "node1"} and all(
            float(s["value"][1]) >= 1 for s in steps
        )
        parts = {s["metric"]["part"] for s in query('hpc_step_part_seconds{run="live",node="node0",instance!=""}')}
        assert {"data", "compute", "optim"} <= parts
        assert_dashboard_queries_return_series(proc)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    assert not target_file.exists()  # the endpoints are gone, so is their announcement
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    # the gateway keeps each node's last push (hpc_running 0), which Prometheus scrapes with honor_labels
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pushed = {s["metric"]["node"]: s for s in query('hpc_running{run="live",job="hpc-trainer",instance=""}')}
        if sorted(pushed) == ["node0", "node1"] and all(s["value"][1] == "0" for s in pushed.values()):
            break
        time.sleep(0.5)
    assert sorted(pushed) == ["node0", "node1"] and all(s["value"][1] == "0" for s in pushed.values()), pushed
    final = {s["metric"]["node"]: s["value"][1] for s in query('hpc_step{run="live",instance=""}')}
    assert final == {"node0": "40", "node1": "40"}
    loss = query('hpc_loss{run="live",node="node0",instance=""}')
    assert float(loss[0]["value"][1]) == pytest.approx(last["loss"], rel=1e-12)
