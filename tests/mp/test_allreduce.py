import pytest

from rundir.contract import SIMULATE_VAR
from tests.conftest import rank_results, run_mpi

pytestmark = pytest.mark.mp


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (1, 4), (4, 1), (2, 3)])
def test_hierarchical_equals_flat_exactly(nodes, per_node, tmp_path):
    """Integer-valued tensors of odd sizes (padding) and a 2-D one: every element of the sum equal."""
    world = nodes * per_node
    proc = run_mpi(
        world,
        ["tests/mp/workers/allreduce_equal.py", str(tmp_path)],
        env={SIMULATE_VAR: str(per_node)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = rank_results(tmp_path)
    assert [r["rank"] for r in got] == list(range(world))
    for r in got:
        assert r["topology"] == [nodes, per_node]
        assert all(r["equal"].values()), r
