"""Tracking (tracking/, trainer/observe/tracker_sink.py) against a real embedded MLflow store: where a run
is tracked, and rank 0's sink sending each step once across a failed launch, a resume and a kill mid-send."""

import json
import os
import time
from pathlib import Path

import pytest

from runconfig import ConfigError, dump_yaml, load_config
from runconfig.schema import TrackingConfig
from rundir import RunDir
from tracking import TrackingState, metric_points, resolve, store_problem
from trainer.observe.tracker_sink import Tracker


def test_where_a_run_is_tracked(tmp_path):
    rundir = RunDir(tmp_path / "runs" / "r1")
    embedded = resolve(TrackingConfig(), rundir, {})
    assert embedded.uri == f"sqlite:///{tmp_path}/runs/mlflow.db" and embedded.run_name == "r1"
    assert embedded.artifact_location == f"{tmp_path}/runs/mlartifacts"
    assert resolve(TrackingConfig(), rundir, {"HPC_TRACKING": "off"}) is None
    assert resolve(TrackingConfig(backend="mlflow"), rundir, {"HPC_TRACKING": "off"}) is not None  # asked for
    server = resolve(TrackingConfig(), rundir, {"MLFLOW_TRACKING_URI": "http://mlflow:5000"})
    assert server.uri == "http://mlflow:5000" and server.artifact_location is None
    assert resolve(TrackingConfig(uri="/data/t.db"), rundir, {}).uri == "sqlite:////data/t.db"
    assert resolve(TrackingConfig(backend="wandb"), rundir, {}).uri == str(rundir.root)


@pytest.mark.parametrize(
    "uri,why",
    [
        ("http://alice:pw@mlflow:5000", "credentials"),
        ("mlflow:5000", "must be an http"),
        ("/data/runs", "must end in .db"),
    ],
)
def test_a_bad_tracking_uri_is_named(uri, why):
    with pytest.raises(ConfigError, match=why) as caught:
        load_config("tiny", [f"tracking.uri={uri}"])
    assert "tracking.uri" in str(caught.value) and "pw" not in str(caught.value)


def test_an_unwritable_store_is_found_before_training(tmp_path):
    file_in_the_way = tmp_path / "file"
    file_in_the_way.write_text("x")
    target = resolve(TrackingConfig(uri=str(file_in_the_way / "m.db")), RunDir(tmp_path / "r"), {})
    assert "cannot be made" in store_problem(target)
    target = resolve(TrackingConfig(uri="/proc/m.db"), RunDir(tmp_path / "r"), {})
    assert "not writable" in store_problem(target)


def test_a_record_becomes_metrics_at_its_step():
    record = {"step": 7, "loss": 2.5, "lr": 1e-3, "time": 1.5, "unit": "tokens", "launch": "L", "grad_norm": None,
              "comm_by_dim": {"dp_replicate": 0.01}, "mfu": float("nan"), "tokens_seen": 640}  # fmt: skip
    points = {k: (v, s, ms) for k, v, s, ms in metric_points(record)}
    assert points == {
        "loss": (2.5, 7, 1500),
        "lr": (1e-3, 7, 1500),
        "tokens_seen": (640.0, 7, 1500),
        "comm_dp_replicate_s": (0.01, 7, 1500),
    }


def records(steps, loss_offset=0.0):
    return [{"step": s, "loss": 3.0 - s / 100 + loss_offset, "step_time_s": 0.1, "time": 1000.0 + s} for s in steps]


def history(rundir, key="loss"):
    from mlflow.tracking import MlflowClient

    state = json.loads(rundir.tracking.read_text())
    client = MlflowClient(state["uri"])
    return client, state["run_id"], [(m.step, m.value) for m in client.get_metric_history(state["run_id"], key)]


def test_each_step_reaches_the_tracker_once_across_a_failure_a_resume_and_a_kill_mid_send(tmp_path):
    rundir = RunDir(tmp_path / "runs" / "run")
    rundir.create()
    rundir.config.write_text(dump_yaml(load_config("tiny")))
    target = resolve(TrackingConfig(backend="mlflow"), rundir, {})
    params = {"train.lr": "0.001"}

    # Launch 1: steps 1-9 logged, a checkpoint commits step 5, then the launch fails. Only 1-5 go.
    first = Tracker(target, rundir, params, flush_timeout_s=30)
    first.begin(0, {"hpc.launches": "1"}, [])
    for r in records(range(1, 10)):
        first.write(r)
        if r["step"] == 5:
            first.committed(5)
    # The sender opened its run at normal priority; sending, every thread of it runs at SCHED_IDLE (only the CPU time
    # the ranks leave idle)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sent_through(rundir) < 5:
        time.sleep(0.1)
    tasks = Path(f"/proc/{first._proc.pid}/task")
    policies = {(t, (tasks / t / "comm").read_text().strip()): os.sched_getscheduler(int(t)) for t in os.listdir(tasks)}
    assert set(policies.values()) == {os.SCHED_IDLE}, policies
    first.close()  # no finish(): a failed launch
    _, run_id, got = history(rundir)
    assert [s for s, _ in got] == [1, 2, 3, 4, 5]
    rundir.metrics.write_text("".join(json.dumps(r) + "\n" for r in records(range(1, 6))))  # truncate_metrics' work

    # Launch 2 resumes at 5 and recomputes 6-12 with other values (another world size); killed while sending 6-10:
    # the tracker took them, tracking.json still says 5 with 10 in flight.
    state = TrackingState.load(rundir.tracking, target)
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(target.uri)
    client.log_batch(run_id, metrics=[Metric(k, v, int(r["time"] * 1000), r["step"]) for r in records(range(6, 11), 0.5)
                                      for k, v in r.items() if k in ("loss", "step_time_s")])  # fmt: skip
    state.in_flight_through = 10
    state.save(rundir.tracking)
    rundir.metrics.write_text("".join(json.dumps(r) + "\n" for r in records(range(1, 11), 0.5)))

    # Launch 3 resumes at 10 (metrics.jsonl holds 1-10), recomputes nothing it has, logs 11-14 and is done.
    third = Tracker(target, rundir, params, flush_timeout_s=30)
    third.begin(10, {"hpc.launches": "3"}, [(rundir.config, None)])
    for r in records(range(11, 15), 0.5):
        third.write(r)
    third.finish("done")
    third.close()
    client, again, got = history(rundir)
    assert again == run_id
    assert [s for s, _ in got] == list(range(1, 15))  # every step once
    assert [v for s, v in got if s > 5] == [r["loss"] for r in records(range(6, 15), 0.5)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["hpc.launches"] == "3" and run.data.params == params
    assert json.loads(rundir.tracking.read_text())["sent_through"] == 14
    assert [a.path for a in client.list_artifacts(run_id)] == ["config.yaml"]


def sent_through(rundir: RunDir) -> int:
    try:
        return json.loads(rundir.tracking.read_text()).get("sent_through", -1)
    except (OSError, ValueError):
        return -1


def wandb_records(folder) -> list:
    """Every protobuf Record in W&B's offline files under ``folder`` (their transaction logs: 32 KiB blocks of
    chunks, each a 7-byte header of CRC, length and kind (full, first, middle, last))."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for path in sorted(folder.glob("offline-run-*/run-*.wandb")):
        data, pos, chunks, part = path.read_bytes(), 7, [], b""
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            space = 32768 - pos % 32768
            if space < 7:
                pos += space
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind == 1:
                chunks.append(chunk)
            elif kind in (2, 3):
                part = (part if kind == 3 else b"") + chunk
            elif kind == 4:
                chunks.append(part + chunk)
        for chunk in chunks:
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
    return out


def wandb_history(folder) -> list[tuple[int, float]]:
    """(step, loss) of every history record in W&B's offline files under ``folder``."""
    out = []
    for record in wandb_records(folder):
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            if "loss" in items:
                out.append((int(items["_step"]), items["loss"]))
    return out


def test_a_sweep_element_is_grouped_by_its_sweep_in_wandb(tmp_path):
    sweep = tmp_path / "sweep-lr"
    rundir = RunDir(sweep / "000-lr=0.001")
    rundir.create()
    (sweep / "sweep.json").write_text("{}")
    target = resolve(TrackingConfig(backend="wandb"), rundir, {})
    assert target.group == "sweep-lr"
    assert resolve(TrackingConfig(backend="wandb"), RunDir(tmp_path / "alone"), {}).group is None  # not in a sweep
    tracker = Tracker(target, rundir, {"train.lr": "0.001"}, flush_timeout_s=60)
    tracker.begin(0, {"hpc.launches": "1"}, [])
    for r in records(range(1, 3)):
        tracker.write(r)
    tracker.finish("done")
    tracker.close()
    runs = [r.run for r in wandb_records(rundir.root / "wandb") if r.WhichOneof("record_type") == "run"]
    assert runs and all(r.run_group == "sweep-lr" for r in runs)


def test_wandb_offline_is_the_same_interface_and_each_step_goes_once(tmp_path):
    rundir = RunDir(tmp_path / "runs" / "run")
    rundir.create()
    rundir.config.write_text(dump_yaml(load_config("tiny")))
    target = resolve(TrackingConfig(backend="wandb"), rundir, {})
    first = Tracker(target, rundir, {"train.lr": "0.001"}, flush_timeout_s=60)
    first.begin(0, {"hpc.launches": "1"}, [])
    for r in records(range(1, 10)):
        first.write(r)
        if r["step"] == 5:
            first.committed(5)
    first.close()  # failed after step 9: 6-9 are recomputed by the next launch
    rundir.metrics.write_text("".join(json.dumps(r) + "\n" for r in records(range(1, 6))))
    second = Tracker(target, rundir, {"train.lr": "0.001"}, flush_timeout_s=60)
    second.begin(5, {"hpc.launches": "2"}, [(rundir.config, None)])
    for r in records(range(6, 13), 0.5):
        second.write(r)
    second.finish("done")
    second.close()
    state = json.loads(rundir.tracking.read_text())
    assert state["backend"] == "wandb" and state["sent_through"] == 12
    got = wandb_history(rundir.root / "wandb")
    assert [s for s, _ in got] == list(range(1, 13)), got  # two offline folders, one run id, every step once
    assert [v for s, v in got if s > 5] == [r["loss"] for r in records(range(6, 13), 0.5)]
    folders = sorted((rundir.root / "wandb").glob("offline-run-*"))
    # W&B names them offline-run-TIME-RUNID, with a -N suffix for a second folder made within the same second
    assert len(folders) == 2 and all(f"-{state['run_id']}" in f.name for f in folders), folders


def test_a_queue_past_its_bound_is_read_back_from_metrics_jsonl_and_each_step_goes_once(tmp_path, monkeypatch):
    from tracking import hold_lock
    from trainer.observe import tracker_agent

    monkeypatch.setattr(tracker_agent, "MAX_QUEUED", 5)
    rundir = RunDir(tmp_path / "runs" / "run")
    rundir.create()
    target = resolve(TrackingConfig(backend="mlflow"), rundir, {})
    lock = hold_lock(rundir, wait=True)  # the sender cannot send meanwhile: a tracker that is down
    sender = tracker_agent.Sender(target, rundir, {"train.lr": "0.001"})
    sender.begin(0, {"hpc.launches": "1"}, [])
    with open(rundir.metrics, "a") as f:
        for r in records(range(1, 31)):
            f.write(json.dumps(r) + "\n")  # rank 0 writes a record before handing it over
            f.flush()
            sender.write(r)
            if r["step"] % 4 == 0:
                sender.committed(r["step"])
    assert len(sender._ready) <= 5 and sender._spilled_through >= 20  # dropped from memory, not kept
    lock.close()  # the tracker is reachable again
    sender.finish("done")
    sender.close()
    assert [s for s, _ in history(rundir)[2]] == list(range(1, 31))  # every step once, in order
    assert json.loads(rundir.tracking.read_text())["sent_through"] == 30


# Run in the killed process: create_store, held still (not changed) at the first UPDATE of alembic's version row,
# that is once the first migration has run in the temporary file and before any rename: the kill lands there.
PAUSE_MID_MIGRATION = """
import sys, threading
from sqlalchemy import event
from sqlalchemy.engine import Engine
from tracking import Target, create_store

@event.listens_for(Engine, "before_cursor_execute")
def pause(conn, cursor, statement, *args):
    if statement.lstrip().upper().startswith("UPDATE ALEMBIC_VERSION"):
        print("mid-migration", flush=True)
        threading.Event().wait()  # until killed

create_store(Target("mlflow", sys.argv[1], "e", "r", sys.argv[2]))
print("finished", flush=True)
"""


def test_a_store_creation_killed_part_way_leaves_no_half_made_store(tmp_path):
    import select
    import signal
    import subprocess
    import sys

    from tracking import create_store

    rundir = RunDir(tmp_path / "runs" / "run")
    rundir.create()
    target = resolve(TrackingConfig(backend="mlflow"), rundir, {})
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSE_MID_MIGRATION, target.uri, target.artifact_location],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert select.select([proc.stdout], [], [], 120)[0], "the store's creation did not reach its migrations"
        assert proc.stdout.readline() == "mid-migration\n", proc.poll()
        store = target.store_path
        (creating,) = store.parent.glob(f".{store.name}.creating-{proc.pid}")  # the migrations run in its own file
        assert creating.stat().st_size > 0 and not store.exists()
        proc.send_signal(signal.SIGKILL)  # like a sender ended with its launch
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert creating.exists() and not store.exists()  # the half-made store was left out of place
    create_store(target)  # the next opener makes it whole
    assert not list(store.parent.glob(f".{store.name}.creating-*"))  # and removes what the killed one left
    from mlflow.tracking import MlflowClient

    client = MlflowClient(target.uri)
    assert client.create_experiment("x") and client.get_experiment_by_name("x") is not None
