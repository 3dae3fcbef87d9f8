"""Silent corruption with real launches (monitor.replica_check_every): one bit flipped in one replica's weights is
caught at the next check, the replica's node named and left out, and the run goes on from the newest checkpoint
(checked at its step) on the remaining node, to its end."""

import pytest

from rundir.paths import read_jsonl
from tests.mp.test_checkpoint import common, run

pytestmark = pytest.mark.mp


def test_a_flipped_bit_in_one_replica_is_caught_its_node_left_out_and_the_run_resumes(tmp_path, small_dataset):
    run_dir = tmp_path / "run"
    sets = [
        *common(small_dataset), "train.steps=12", "monitor.replica_check_every=3", "job.min_nodes=1",
        "job.max_failures=1", "job.restart_backoff_s=0.2",
    ]  # fmt: skip
    done = run(run_dir, sets, inject="bitflip:3:6")  # after step 6 on rank 3 (node1); checks at 3, 4 (ckpt), 6
    assert done.returncode == 0, done.stdout + done.stderr
    events = read_jsonl(run_dir / "history.jsonl")
    bad = next(e for e in events if e["event"] == "bad_node")
    assert bad["node"] == "node1" and "silent corruption: at step 6" in bad["reason"], bad
    assert "rank 3 (node1)" in bad["reason"]
    restart = next(e for e in events if e["event"] == "restart")
    assert restart["cause"].startswith("silent corruption"), restart
    resumed = [e for e in events if e["event"] == "resume"]
    assert resumed and resumed[0]["step"] == 4 and resumed[0]["world_size"] == 2  # the checked checkpoint, node0
    assert events[-1]["event"] == "done" and events[-1]["step"] == 12
