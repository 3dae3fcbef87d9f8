import pytest

from rundir.contract import SIMULATE_VAR
from tests.conftest import rank_results, run_mpi

pytestmark = pytest.mark.mp


def test_hierarchical_hooks_match_plain_ddp(tmp_path):
    """After K steps, DDP with each algorithm's hook (hierarchical, leader, two_level, auto's plan) holds the same
    parameters as plain DDP (to float rounding: the two sum in different orders), for one bucket and for many
    small, padded buckets. AdamW magnifies
    rounding in parameters whose gradients are tiny, so the bound is relative to how far training moved the
    parameters: a hook that lost or double-counted a rank's gradient misses it by orders of magnitude. The
    trainer's hook (overlapped with backward, on a thread of its own) ends bit-identical to the same algorithm run
    synchronously inside the hook; the start-up check of the overlapped path passes it and catches one that
    returns buckets unreduced."""
    proc = run_mpi(4, ["tests/mp/workers/ddp_hook_vs_plain.py", str(tmp_path), "10"], env={SIMULATE_VAR: "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = rank_results(tmp_path)
    assert len(results) == 4
    assert len(results[0]["runs"]) == 6
    for r in results:
        assert r["check_real"] == [] and r["check_unreduced"] == [0, 1, 2, 3], r  # every rank names the same
        assert r["plan"] == results[0]["plan"]  # every rank chose alike
        assert r["plain_hook"] in (None, "")
        assert r["moved"] > 1e-3
        for bucket, run in r["runs"].items():
            assert run["hook"] == "overlapped_hook" and run["sync_hook"] == "sync_hook", (bucket, run)
            assert run["max_abs_diff"] < 1e-3 * r["moved"], (r["rank"], bucket, run, r["moved"])
            assert run["same_as_sync"], (r["rank"], bucket, run)
