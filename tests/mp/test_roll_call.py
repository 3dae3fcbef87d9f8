"""The watchdog's roll call after a failed collective (trainer/observe/watchdog.py): real ranks, real store."""

import pytest

from tests.conftest import rank_results, run_mpi

pytestmark = pytest.mark.mp


def test_a_frozen_rank_is_named_within_the_answer_window(tmp_path):
    proc = run_mpi(3, ["tests/mp/workers/roll_call.py", str(tmp_path), "2"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = rank_results(tmp_path)
    assert [r["rank"] for r in got] == [0, 1], got
    for r in got:
        assert r["suspects"] == [2] and "rank(s) 2 did not answer within 1 s (ended or frozen)" in r["text"], r
        # The answer window (1 s at monitor.heartbeat_s=1), not the 4 heartbeats the diagnosis used to wait out.
        assert 0.9 < r["seconds"] < 2.5, r


def test_when_every_rank_answers_nobody_is_named_at_once(tmp_path):
    proc = run_mpi(3, ["tests/mp/workers/roll_call.py", str(tmp_path), "-1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = rank_results(tmp_path)
    assert [r["rank"] for r in got] == [0, 1, 2], got
    for r in got:
        assert r["suspects"] == [] and r["text"] == "", r
        assert r["seconds"] < 0.9, r  # all answered: no waiting out the window
