"""The Slurm benchmark at a toy size on the session's cluster (``--slurm-conf``: the script starts none of its own):
bench/preemption.py, one interruption, run as a user would. The other benchmarks, recovery.py's local part among
them: tests/bench/test_benchmarks.py (its Slurm methods, kill and requeue, are left out: ~16 s each here, on the
one worker that runs every Slurm test; ``--methods kill --slurm-conf FILE`` runs one the same way)."""

from __future__ import annotations

import pytest

from tests.bench.helpers import positive, run_bench, table_lines

pytestmark = pytest.mark.slurm


def test_preemption(slurm, tmp_path):
    """One preemption by a job in the higher-priority partition (the path that needs the cluster's urgent
    partition and its PreemptMode=REQUEUE): committed, running again, resumed, first new step."""
    res, out = run_bench(
        "preemption", ["--reps", "1", "--methods", "preempt", "--slurm-conf", str(slurm / "slurm.conf")], tmp_path
    )
    assert res["benchmark"] == "preemption"
    assert res["setup"]["reps"] == 1 and res["setup"]["methods"] == ["preempt"]
    assert list(res["summary"]) == ["preempt"]
    [run] = res["runs"]
    assert run["method"] == "preempt"
    med = res["summary"]["preempt"]
    for key in ("committed_s", "running_again_s", "resumed_s", "first_new_step_s"):
        assert positive(med[key]) and med[key] == run[key], (key, med, run)
    assert med["committed_s"] < med["running_again_s"] < med["resumed_s"] <= med["first_new_step_s"]
    assert run["steps_recomputed"] >= 0 and run["to_process_start_s"] >= 0
    assert {"imports", "restore"} <= set(run["startup_s"])
    header, row, phases = table_lines(out, "interruption ", "preempt ", "interruption   to start")
    assert "first_new_step_s" in header and len(row.split()) == 5
    assert "imports" in phases
