import pytest

from trainer.errors import UserError
from trainer.parallel.topology import Topology


@pytest.mark.parametrize(
    "nodes,per_node,intra,inter",
    [
        (2, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
        (1, 4, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
        (4, 1, [[0], [1], [2], [3]], [[0, 1, 2, 3]]),
        (2, 3, [[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]]),
    ],
)
def test_groups(nodes, per_node, intra, inter):
    topo = Topology(nodes * per_node, per_node)
    assert topo.num_nodes == nodes
    assert topo.mesh_shape == (nodes, per_node)
    assert topo.intra_groups() == intra
    assert topo.inter_groups() == inter
    assert topo.mesh() == intra
    for rank in range(topo.world_size):
        node, local = topo.node_of(rank), topo.local_rank(rank)
        assert rank in intra[node] and rank in inter[local]
        assert intra[node][local] == rank
    # every rank appears exactly once in each partition
    assert sorted(r for g in intra for r in g) == list(range(topo.world_size))
    assert sorted(r for g in inter for r in g) == list(range(topo.world_size))


def test_world_not_divisible_names_the_partial_node():
    with pytest.raises(UserError, match=r"world size 6 is not divisible by 4 ranks per node \(ranks 4..5"):
        Topology(6, 4)


def test_from_node_ids():
    assert Topology.from_node_ids([0, 0, 1, 1]) == Topology(4, 2)
    assert Topology.from_node_ids([0, 0, 0]) == Topology(3, 3)
    with pytest.raises(UserError, match="different numbers of ranks"):
        Topology.from_node_ids([0, 0, 0, 1])
    with pytest.raises(UserError, match="not contiguous"):
        Topology.from_node_ids([0, 1, 0, 1])


def test_rank_out_of_range():
    with pytest.raises(ValueError):
        Topology(4, 2).node_of(4)
