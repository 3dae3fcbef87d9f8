"""``python -m hpc selftest`` against the real local Slurm cluster: the configured signal is sent as Slurm sends it
before the time limit (scancel --signal to the job's steps); every rank must record receiving it itself, and a
launch wrapper that swallows it (tests/slurm/workers/swallow_signal.py as job.launch_prefix) must be caught and
named."""

import json

import pytest

from rundir.contract import EVENT_STOPPED, EXIT_FAILED
from rundir.paths import RunDir
from rundir.stopsignal import STEPD
from tests.conftest import PY, ROOT, history, run_cli
from tests.slurm.conftest import sets_for

pytestmark = pytest.mark.slurm

WRAPPER = ROOT / "tests" / "slurm" / "workers" / "swallow_signal.py"


def selftest(run_dir, sets, *extra):
    args = ["-m", "hpc", "selftest", "tiny", "--run-dir", str(run_dir), "--timeout", "240", *extra]
    for s in sets:
        args += ["--set", s]
    return run_cli(args, timeout=400)


def test_every_rank_receives_the_signal_and_the_lead_covers_the_stop(slurm, small_dataset, tmp_path):
    run_dir = tmp_path / "run"
    proc = selftest(run_dir, sets_for(small_dataset), "--json")  # 2 nodes x 2 ranks, SIGUSR2, lead 120 s
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["status"] == 0 and out["received"] == [0, 1, 2, 3] and out["missing"] == []
    assert {c["level"] for c in out["checks"]} == {"PASS"}, out["checks"]
    assert {c["what"] for c in out["checks"]} == {"sbatch", "signal", "stop", "lead"}
    assert out["sbatch_signal"] == "USR2@120"
    assert 0 <= out["stop_s"] < out["signal_to_commit_s"] and 0 < out["save_s"] < out["signal_to_commit_s"]
    assert out["required_lead_s"] <= 120
    # Each rank recorded the signal itself (none learned it from the others) and its chain up to slurmstepd,
    # with nothing in between.
    stopped = [e for e in history(run_dir) if e["event"] == EVENT_STOPPED]
    assert len(stopped) == 1 and stopped[0]["received"] == {"SIGUSR2": [0, 1, 2, 3]} and stopped[0]["learned"] == []
    for rank in range(4):
        record = RunDir(run_dir).signal_records()[rank]  # one file a node (ranks_per_node=2: two files)
        assert record["chain"][0]["cmdline"][-3:] == ["trainer", "--run-dir", str(run_dir)]
        assert [p["name"] for p in record["chain"]][-1] == STEPD and len(record["chain"]) == 2, record["chain"]
    assert out["wrappers"] == {str(r): [] for r in range(4)}
    assert not (run_dir / "checkpoints").exists()  # thrown away (--keep keeps them)


def test_a_wrapper_that_swallows_the_signal_is_caught_and_named(slurm, small_dataset, tmp_path):
    run_dir = tmp_path / "run"
    sets = [
        *sets_for(small_dataset), "job.ranks_per_node=1", "job.signal_lead_s=10",
        f"job.launch_prefix=[{PY}, {WRAPPER}, SIGUSR2]",
    ]  # fmt: skip
    proc = selftest(run_dir, sets)
    assert proc.returncode == EXIT_FAILED, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "FAIL signal: no rank received SIGUSR2" in proc.stdout, proc.stdout
    named = [x for x in lines if x.startswith("FAIL signal: ranks 0-1: ")]  # alike on both ranks: one line
    assert len(named) == 1, proc.stdout
    assert "blocked since it started" in named[0]
    assert f"between slurmstepd and the rank: `{PY} {WRAPPER} SIGUSR2 {PY} -u -m trainer" in named[0]
    assert named[0].endswith("(blocks SIGUSR2)")
    assert lines[-1] == "selftest: failed (exit status 1)"
    assert not any(x.startswith(("PASS lead", "FAIL lead")) for x in lines)  # nothing to measure
