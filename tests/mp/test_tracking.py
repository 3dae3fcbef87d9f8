"""Experiment tracking with real launches: one MLflow run per run directory across an in-job restart, a stop by
signal and a resume, its history equal to metrics.jsonl (one value per step); a real `mlflow server`
(envs/mlflow/server.sh) that goes down mid-run and comes back; a tracker unreachable for a whole run, caught up by
`hpc report`; a store that cannot be written, named before training."""

import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rundir.checkpoints import latest_committed, read_latest, validate
from rundir.contract import EXIT_STOPPED, EXIT_USER_ERROR
from rundir.paths import read_jsonl
from tests.conftest import PY, ROOT, as_user, make_other_user, rank_pids, wait_for_step
from tests.mp.test_checkpoint import TWO_NODES, common, run, start, wait_for_event

pytestmark = pytest.mark.mp

# rank 0 sleeps 30 ms per step: the launches last long enough to be interrupted where the test means to
SLOW = "slow:0:0.03"


def tracked(data, *more) -> list[str]:
    return [*common(data), *TWO_NODES, "train.steps=40", "tracking.backend=mlflow", "train.log_every=1", *more]


def client_and_run(run_dir):
    from mlflow.tracking import MlflowClient

    state = json.loads((Path(run_dir) / "tracking.json").read_text())
    return MlflowClient(state["uri"]), state["run_id"], state


def assert_history_is_metrics_jsonl(client, run_id, run_dir, steps: int = 40) -> None:
    """For each metric, the tracker holds exactly metrics.jsonl's (step, value) pairs: no step twice, none lost."""
    records = read_jsonl(Path(run_dir) / "metrics.jsonl")
    for key in ("loss", "step_time_s", "eval_loss"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        want = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        assert got == want, (key, got[:5], want[:5])
    logged = [r["step"] for r in records]
    assert logged == sorted(set(logged)) and logged[-1] == steps, logged


def logged_and_committed(run_dir) -> tuple[int, int]:
    """(the last step in metrics.jsonl, the newest committed checkpoint's step), once neither has moved for 0.5 s."""
    seen, since = None, time.monotonic()
    while time.monotonic() - since < 0.5:
        manifest = latest_committed(run_dir / "checkpoints")
        now = (max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")), manifest["step"] if manifest else 0)
        if now != seen:
            seen, since = now, time.monotonic()
        time.sleep(0.05)
    return seen


def kill_after_a_logged_uncommitted_step(run_dir, proc, rank: int, after: int) -> int:
    """SIGKILL ``rank`` once step ``after`` is logged, at a moment when steps logged since the newest checkpoint will
    be computed again (a kill landing just after a commit would recompute nothing): the rank is frozen (SIGSTOP),
    so the run cannot log or commit past the step it is in, and let go one step further while nothing would be
    recomputed. Returns the last logged step."""
    wait_for_step(run_dir, after, proc)
    pid = rank_pids(run_dir)[rank]
    while True:
        os.kill(pid, signal.SIGSTOP)
        logged, committed = logged_and_committed(run_dir)
        if logged > committed:
            os.kill(pid, signal.SIGKILL)
            return logged
        os.kill(pid, signal.SIGCONT)
        wait_for_step(run_dir, logged + 1, proc)


def test_one_tracker_run_across_a_restart_a_stop_and_a_resume(tmp_path, small_dataset):
    run_dir = tmp_path / "runs" / "run"
    # a flush long enough for a loaded machine: a tracker that took the queue late would be noise in the logs; and
    # watchdogs that outlast its stalls (CI once saw rank 0's store silent for 31 s, a hang and a fourth launch)
    sets = tracked(small_dataset, "job.max_failures=2", "job.restart_backoff_s=0.2", "tracking.flush_timeout_s=120",
                   "monitor.hang_timeout_s=180", "monitor.peer_timeout_s=180")  # fmt: skip
    proc = start(run_dir, sets, inject=SLOW)
    logged = kill_after_a_logged_uncommitted_step(run_dir, proc, rank=1, after=6)  # the launch fails: restarted
    resumed = wait_for_event(run_dir, "resume", 1, proc)
    assert resumed["step"] < logged and resumed["discarded_records"] == logged - resumed["step"], (resumed, logged)
    wait_for_step(run_dir, resumed["step"] + 6, proc)
    os.kill(rank_pids(run_dir)[0], signal.SIGUSR2)  # a stop with a committed checkpoint
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == EXIT_STOPPED, out + err
    client, run_id, _ = client_and_run(run_dir)
    assert client.get_run(run_id).info.status == "KILLED"  # stopped, to be continued
    done = run(run_dir, sets, resume=True)
    assert done.returncode == 0, done.stdout + done.stderr

    client, again, state = client_and_run(run_dir)
    assert again == run_id and state["sent_through"] == 40
    assert state["uri"] == f"sqlite:///{tmp_path}/runs/mlflow.db"  # the embedded store, beside the run directory
    runs = client.search_runs([client.get_experiment_by_name("hpc-trainer").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # one run for the three launches
    assert_history_is_metrics_jsonl(client, run_id, run_dir)
    assert (run_dir / "metrics.discarded.jsonl").exists()  # steps were recomputed: none of them went twice
    run_ = client.get_run(run_id)
    tags, params = run_.data.tags, run_.data.params
    assert run_.info.status == "FINISHED" and tags["hpc.state"] == "done"
    assert tags["hpc.launches"] == "3" and tags["hpc.restarts"] == "1" and tags["hpc.world_size"] == "2"
    assert tags["hpc.hosts"] == "node0,node1" and json.loads(tags["hpc.layout"])["dp_replicate"] == 2
    assert tags["hpc.torch"].startswith("2.13.0") and tags["hpc.mpi"].startswith("MPICH")
    assert params["train.steps"] == "40" and params["model.d_model"] == "64" and params["tracking.backend"] == "mlflow"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "summary.json", "record"} <= artifacts, artifacts
    launches = {a.path for a in client.list_artifacts(run_id, "record")}
    assert {"record/launch-000.json", "record/launch-002.json", "record/submit-001.json"} <= launches, launches
    manifest = validate(run_dir / "checkpoints" / read_latest(run_dir / "checkpoints"))
    assert manifest["tracking_run_id"] == run_id
    text = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    noise = [line for line in text.splitlines() if "tracking:" in line or "mlflow.store" in line]
    assert not noise, noise  # nothing to warn of, no noise
    assert_the_ui_shows(tmp_path / "runs", state, run_id)


def browse(url: str, profile: Path, ready, deadline_s: float = 300) -> str:
    """The page's DOM once headless Chromium (Debian's) has run its scripts and their requests, loaded again until
    ``ready(dom)`` (a loaded machine can dump the page before its lazily drawn parts are there) or the deadline:
    the last DOM, for the caller's assertions."""
    args = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}"]
    # tall: MLflow draws only the charts in view (alphabetical; the run's 18 fit), whatever metrics a run adds
    args += ["--virtual-time-budget=60000", "--window-size=1400,4000", "--dump-dom", url]
    deadline = time.monotonic() + deadline_s
    while True:
        page = subprocess.run(args, capture_output=True, text=True, timeout=180)
        assert page.returncode == 0 and page.stdout, page.stderr[-2000:]
        if ready(page.stdout) or time.monotonic() > deadline:
            return page.stdout
        print(f"browse: {url[-40:]} not ready, loaded again", flush=True)
        time.sleep(2)


def param_row(key: str, value: str) -> str:
    """A params table row holding ``key`` and ``value`` (not a later row's value)."""
    return rf">{re.escape(key)}</span>(?:(?!role=\"row\").){{0,400}}?title=\"{value}\""


def loss_card(dom: str) -> str:
    """The loss chart's card (up to the next card's title), or ""."""
    card = dom.find('title="loss">loss</h4>')
    if card < 0:
        return ""
    end = dom.find("<h4", card + 1)
    return dom[card : end if end > 0 else len(dom)]


def curves(card: str) -> list[str]:
    return re.findall(r'<path class="js-line" d="([^"]*)"', card)


def assert_the_ui_shows(runs: Path, state: dict, run_id: str) -> None:
    """`hpc ui` over the embedded store, opened in a real browser: the run, its params, its loss chart; a request
    without the session's token is refused, and a second Unix user reaches neither the UI nor MLflow's socket."""
    ui = subprocess.Popen(
        [PY, "-m", "hpc", "ui", str(runs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        line = ui.stdout.readline()  # the URL once the server answers, or nothing if the command ended
        assert "?token=" in line, line + ui.communicate(timeout=30)[1]
        url = line.split(": ", 1)[1].strip()
        base = url.split("?")[0]
        for bad in (base, f"{base}?token=not-it", f"{base}ajax-api/2.0/mlflow/experiments/search"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(bad, timeout=30)
            assert refused.value.code == 403, bad
        if os.geteuid() == 0:  # another user of the host: the port without the token, and MLflow's own socket
            other = make_other_user()
            sock = max(Path(tempfile.gettempdir()).glob("hpc-ui-*/mlflow.sock"), key=lambda p: p.stat().st_mtime)
            attack = (
                "import socket, sys, urllib.error, urllib.request\n"
                "try:\n urllib.request.urlopen(sys.argv[1], timeout=30); print('port: open')\n"
                "except urllib.error.HTTPError as e:\n print('port:', e.code)\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                "try:\n s.connect(sys.argv[2]); print('socket: connected')\n"
                "except OSError as e:\n print('socket:', e.strerror)\n"
            )
            tried = as_user(
                other, ["/usr/bin/python3", "-c", attack, f"{base}ajax-api/2.0/mlflow/runs/search", str(sock)]
            )
            assert tried.stdout.split("\n")[:2] == ["port: 403", "socket: Permission denied"], tried
        profile = runs.parent / "chromium-profile"  # in the test's own temporary folder
        run_page = f"{url}#/experiments/{state['experiment_id']}/runs/{run_id}"
        params = (("train.steps", "40"), ("model.d_model", "64"), ("tracking.backend", "mlflow"))
        overview = browse(run_page, profile, lambda dom: all(re.search(param_row(k, v), dom) for k, v in params))
        assert re.search(r'data-testid="runs-header">run<', overview), overview[-3000:]
        for key, value in params:
            assert re.search(param_row(key, value), overview), key
        charts = browse(f"{run_page}/model-metrics", profile, lambda dom: curves(loss_card(dom)))
        plot = loss_card(charts)
        assert plot, "no loss chart card"
        lines = curves(plot)
        assert lines and lines[0].count("L") >= 30, lines  # a curve through the 40 steps (the eval too)
        assert re.search(r'class="xtitle"[^>]*>Step<', plot)
    finally:
        ui.send_signal(signal.SIGINT)
        assert ui.wait(timeout=60) == 0, ui.stderr.read()


def free_port() -> int:
    """A port nothing listens on, between the suite's fixed ports (below 20000) and the kernel's ephemeral range
    (32768 up by default): the server is stopped and started again on it, and meanwhile the kernel cannot hand it
    to another process (the other worker's launches: their stores, gloo and MPI listeners, their outgoing
    connections), as it could a port from bind(("", 0))."""
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(20000, ephemeral), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in 20000-{ephemeral - 1}")


class Server:
    """envs/mlflow/server.sh on a free port, its store in a temporary folder."""

    def __init__(self) -> None:
        self.port = free_port()
        self.state = Path(tempfile.mkdtemp(prefix="hpc-mlflow-test-", dir="/tmp"))
        self.uri = f"http://127.0.0.1:{self.port}"

    def script(self, verb: str) -> None:
        env = {**os.environ, "PYTHON": PY, "HPC_MLFLOW_PORT": str(self.port)}
        subprocess.run(["bash", "envs/mlflow/server.sh", verb, str(self.state)], check=True, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def server():
    """One server for the module, started by the tests that need it up (the first one finds it down)."""
    s = Server()
    yield s
    s.script("wipe")


def test_an_unreachable_tracker_costs_a_warning_and_the_report_catches_up(tmp_path, small_dataset, server):
    run_dir = tmp_path / "run"
    sets = tracked(small_dataset, f"tracking.uri={server.uri}", "tracking.flush_timeout_s=1", "cost.node_hour=3600")
    sets.append("monitor.peak_tflops=1")  # an MFU on CPU: the program part of the goodput split is known
    server.script("stop")
    done = run(run_dir, sets)  # nothing listens on the port
    assert done.returncode == 0, done.stdout + done.stderr
    log = (run_dir / "logs" / "rank_00000.log").read_text()
    assert f"tracking: mlflow {server.uri} failed" in log and "steps 1..40 not sent" in log, log
    state = json.loads((run_dir / "tracking.json").read_text()) if (run_dir / "tracking.json").exists() else {}
    assert state.get("sent_through", 0) == 0
    server.script("start")
    report = subprocess.run(
        [PY, "-m", "hpc", "report", str(run_dir)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert report.returncode == 0 and "40 step record(s) it lacked" in report.stdout, report.stdout + report.stderr
    client, run_id, state = client_and_run(run_dir)
    assert state["sent_through"] == 40 and state["unsent"] == []
    assert_history_is_metrics_jsonl(client, run_id, run_dir)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert "report/report.md" in {a.path for a in client.list_artifacts(run_id, "report")}
    # the cost and the goodput split, at the final step: the launch's wall x its two (simulated) nodes, priced
    data = client.get_run(run_id).data
    (start,) = [e for e in read_jsonl(run_dir / "history.jsonl") if e["event"] == "start"]
    (end,) = [e for e in read_jsonl(run_dir / "history.jsonl") if e["event"] == "done"]
    wall = end["time"] - start["process_start"]
    assert data.metrics["cost/node_hours"] == pytest.approx(2 * wall / 3600, rel=1e-6)
    assert data.metrics["cost/total"] == pytest.approx(2 * wall, rel=1e-6) and data.metrics["cost/gpu_hours"] == 0
    parts = [data.metrics[f"goodput/{p}"] for p in ("scheduling", "runtime", "program")]
    assert all(0 < p <= 1 for p in parts), parts
    assert data.metrics["goodput/overall"] == pytest.approx(math.prod(parts))
    assert data.tags["hpc.cost_source"] == "launches" and data.tags["hpc.currency"] == "USD"
    assert [m.step for m in client.get_metric_history(run_id, "cost/total")] == [40]


def test_a_server_that_goes_down_mid_run_and_comes_back(tmp_path, small_dataset, server):
    """The run trains on while the server is down (a warning, metrics kept), and the tracker catches up when it is
    back: the history is still metrics.jsonl's, one value per step."""
    server.script("start")  # already up after the test before
    run_dir = tmp_path / "run"
    sets = tracked(small_dataset, f"tracking.uri={server.uri}", "tracking.flush_timeout_s=120")
    proc = start(run_dir, sets, inject="slow:0:0.15")
    wait_for_step(run_dir, 5, proc)
    server.script("stop")
    wait_for_step(run_dir, 16, proc)  # checkpoints at 8, 12, 16 committed while it was down
    server.script("start")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    client, run_id, state = client_and_run(run_dir)
    assert state["uri"] == server.uri and state["sent_through"] == 40
    assert_history_is_metrics_jsonl(client, run_id, run_dir)
    assert client.get_run(run_id).info.status == "FINISHED"
    log = (run_dir / "logs" / "rank_00000.log").read_text()
    assert log.count(f"tracking: mlflow {server.uri} failed") == 1, log  # warned once for the outage
    assert "reachable again" in log


def test_a_store_that_cannot_be_written_is_named_before_training(tmp_path, small_dataset):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run_dir = tmp_path / "run"
    proc = run(run_dir, [*tracked(small_dataset), f"tracking.uri={blocker}/m.db"])
    assert proc.returncode == EXIT_USER_ERROR, proc.stdout + proc.stderr
    failure = json.loads((run_dir / "failure.json").read_text())
    assert "tracking: the store" in failure["message"] and "cannot be made" in failure["message"], failure
    assert not (run_dir / "metrics.jsonl").exists()
    assert not any(e["event"] == "start" for e in read_jsonl(run_dir / "history.jsonl"))
