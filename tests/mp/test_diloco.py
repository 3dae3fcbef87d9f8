"""comm.sync=diloco with real processes: 2 simulated nodes meeting every 4 steps. A stop signal inside a round
stops at the round's end, and the resumed run ends bit-identical to the uninterrupted one; so does a rank killed
after a checkpoint in node memory, restored from it (each node's own optimizer state, the outer momentum), in a new
launch or in the same processes with a warm spare. Streaming (comm.sync_fragments=2): a stop at a round's end, where
the nodes' parameters differ, resumes bit-identical from each node's own parameters in the checkpoint."""

import json
import os
import signal

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.conftest import history, rank_pids, summary, wait_for_step
from tests.mp.test_checkpoint import common, memory_folder, rows, run, start, stopped_by_a_signal

pytestmark = pytest.mark.mp


def diloco(data) -> list[str]:
    return [*common(data), "job.ranks_per_node=1", "comm.sync=diloco", "comm.sync_every=4",
            "checkpoint.every_steps=8"]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, small_dataset):
    run_dir = tmp_path_factory.mktemp("diloco") / "run"
    proc = run(run_dir, diloco(small_dataset))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def assert_same(reference, run_dir) -> None:
    assert summary(run_dir)["params_sha256"] == summary(reference)["params_sha256"]
    assert rows(run_dir) == rows(reference)


def test_diloco_trains_and_a_stop_waits_for_the_rounds_end(tmp_path, small_dataset, uninterrupted):
    losses = [r["loss"] for r in rows(uninterrupted)]
    assert len(losses) == 24 and sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses  # it learns
    assert summary(uninterrupted)["allreduce"] == "diloco"
    run_dir = tmp_path / "run"
    stopped = stopped_by_a_signal(run_dir, diloco(small_dataset), at_step=5, rank=1)
    assert stopped == 8, stopped  # the signal came inside the round 5..8: the stop waited for its end
    done = run(run_dir, resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same(uninterrupted, run_dir)


@pytest.mark.parametrize("spares", [0, 1])
def test_diloco_resumes_from_node_memory_bitwise(tmp_path, small_dataset, uninterrupted, spares):
    """A replica lost inside a round (after step 14; rounds end at 12 and 16) resumes from the round's end in node
    memory: in a new launch, or with a warm spare (job.spare_ranks) in the same launch, the survivor's process kept."""
    run_dir = tmp_path / "run"
    sets = [*diloco(small_dataset), "checkpoint.memory_every_steps=4", "job.max_failures=1",
            "job.restart_backoff_s=0.2", f"job.spare_ranks={spares}"]  # fmt: skip
    proc = start(run_dir, sets)
    wait_for_step(run_dir, 14, proc)
    folder = memory_folder(run_dir)
    os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    (resume,) = [e for e in history(run_dir) if e["event"] == "resume"]
    kinds = [e["event"] for e in history(run_dir) if e["event"] in ("rejoin", "restart")]
    assert kinds == (["rejoin"] if spares else ["restart"]), kinds
    assert resume["restored_from"]["from"] == "memory" and resume["step"] % 4 == 0, resume
    assert resume["step"] >= 12 and resume["restored_from"]["durable_step"] == 8 * (resume["step"] // 8), resume
    assert_same(uninterrupted, run_dir)
    assert not folder.exists()


def test_streaming_diloco_resumes_each_nodes_own_parameters_bitwise(tmp_path, small_dataset):
    sets = [*diloco(small_dataset), "comm.sync_fragments=2", "train.steps=12"]
    reference = tmp_path / "reference"
    proc = run(reference, sets)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "run"
    assert stopped_by_a_signal(run_dir, sets, at_step=5, rank=1) == 8
    (saved,) = [p for p in (run_dir / "checkpoints").iterdir() if (p / "dcp").is_dir()]
    assert json.loads((saved / "manifest.json").read_text())["sync"]["fragments"] == 2
    keys = FileSystemReader(saved / "dcp").read_metadata().state_dict_metadata
    assert {k.split(".")[0] for k in keys} >= {"model", "outer", "outer_node0", "outer_node1"}, sorted(keys)
    done = run(run_dir, resume=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same(reference, run_dir)
