"""The gang preflight's decision (figures in, named nodes out), its ring and turn layouts, and its config checks."""

import pytest

from runconfig import ConfigError, load_config
from trainer.observe.preflight import host_turns, ring_rounds
from trainer.observe.preflight_verdict import better_of, judge
from trainer.parallel.topology import Topology


def rank_figures(world: int, per_node: int, **per_rank_overrides) -> list[dict]:
    """Healthy figures for every rank; ``r2={"intra_gbps": 0.01}`` overrides rank 2's."""
    topo = Topology(world, per_node)
    out = []
    for r in range(world):
        f = {
            "rank": r,
            "device": "cpu test (2 cores)",
            "mem_free_gb": 20.0,
            "mem_total_gb": 32.0,
            "compute_gflops": 100.0,
            "data_read_s": 0.001,
            "data_error": None,
            "seconds": 0.2,
            "links": {},
        }
        if per_node > 1:
            f.update(intra_gbps=1.0, intra_latency_us=200.0)
        if topo.num_nodes > 1:
            f.update(inter_gbps=0.8, inter_latency_us=300.0)
        out.append(f)
    for key, changes in per_rank_overrides.items():
        out[int(key[1:])].update(changes)
    return out


def with_links(figures: list[dict], per_node: int, gbps: dict[tuple[int, int], float]) -> list[dict]:
    """Every rank's ping-pong figure with its ring neighbours, from one figure per node pair."""
    for f in figures:
        node = f["rank"] // per_node
        f["links"] = {b if a == node else a: v for (a, b), v in gbps.items() if node in (a, b)}
    return figures


def test_healthy_nodes_are_summarised_and_nobody_is_named():
    v = judge(rank_figures(4, 2), ranks_per_node=2, margin=0.5)
    assert v.named == {} and v.unreadable is None
    assert [row["ranks"] for row in v.nodes] == [[0, 1], [2, 3]]
    for row in v.nodes:
        assert row["intra_gbps"] == 1.0 and row["inter_latency_us"] == 300.0 and row["compute_gflops"] == 100.0
        assert row["link_gbps"] is None  # two nodes: no ring
    assert any("two nodes" in s for s in v.skipped)


def test_a_slow_intra_node_group_names_its_node_with_the_figures():
    slow = {"intra_gbps": 0.02, "intra_latency_us": 50_000.0}
    v = judge(rank_figures(4, 2, r2=slow, r3=slow), ranks_per_node=2, margin=0.5)
    assert list(v.named) == [1]
    (why,) = v.named[1]
    assert why == "intra-node all-reduce bandwidth 0.02 GB/s is 0.02x the median of the other nodes (1 GB/s)"


def test_margin_is_a_fraction_of_the_median_of_the_other_nodes():
    figures = rank_figures(6, 2, r4={"compute_gflops": 60.0}, r5={"compute_gflops": 60.0})
    assert judge(figures, ranks_per_node=2, margin=0.5).named == {}  # 0.6x > 0.5x
    assert list(judge(figures, ranks_per_node=2, margin=0.3).named) == [2]  # 0.6x < 0.7x
    # The node's figure is the median of its ranks: one slow rank of three does not make the node slow.
    figures = rank_figures(6, 3, r3={"compute_gflops": 1.0})
    assert judge(figures, ranks_per_node=3, margin=0.5).named == {}


def test_little_free_memory_and_slow_compute_are_named():
    figures = rank_figures(3, 1, r0={"mem_free_gb": 2.0}, r2={"compute_gflops": 10.0})
    v = judge(figures, ranks_per_node=1, margin=0.5)
    assert list(v.named) == [0, 2]
    assert v.named[0] == ["free memory 2 GB is 0.10x the median of the other nodes (20 GB)"]
    assert v.named[2][0].startswith("compute 10 GFLOP/s is 0.10x")


def test_the_inter_node_all_reduce_names_nobody():
    # Every node takes part in every inter-node all-reduce: a slow one is slow for all, whoever is at fault.
    figures = rank_figures(4, 2, r2={"inter_gbps": 0.001}, r3={"inter_gbps": 0.001})
    assert judge(figures, ranks_per_node=2, margin=0.5).named == {}


def test_ring_links_name_the_node_whose_best_link_is_slow():
    # 4 nodes x 1 rank: node 2's links to 1 and 3 are slow; nodes 1 and 3 still have one good link each.
    links = {(0, 1): 2.0, (1, 2): 0.1, (2, 3): 0.1, (0, 3): 2.1}
    v = judge(with_links(rank_figures(4, 1), 1, links), ranks_per_node=1, margin=0.5)
    assert [row["link_gbps"] for row in v.nodes] == [2.1, 2.0, 0.1, 2.1]
    assert {tuple(link["nodes"]): link["gbps"] for link in v.links} == links
    assert list(v.named) == [2]
    assert v.named[2] == [
        "best inter-node link (ring ping-pong) 0.1 GB/s is 0.05x the median of the other nodes (2.1 GB/s)"
    ]


def test_a_node_that_cannot_read_its_data_is_named_and_all_nodes_unable_is_the_data():
    error = "recipe 'gpt': train_data[7] raised OSError: [Errno 5] Input/output error"
    v = judge(rank_figures(4, 2, r3={"data_error": error, "data_read_s": None}), ranks_per_node=2, margin=0.5)
    assert v.named == {1: [f"rank 3 cannot read its first data item: {error}"]} and v.unreadable is None
    v = judge(rank_figures(4, 2, r1={"data_error": error}, r3={"data_error": error}), ranks_per_node=2, margin=0.5)
    # Every node: the data is at fault, not a node (reported; the first step's read fails as the loader decides).
    assert v.named == {} and v.unreadable == f"rank 1 cannot read its first data item: {error}"


def test_one_rank_compares_nothing_and_says_so():
    v = judge(rank_figures(1, 1), ranks_per_node=1, margin=0.5)
    assert v.named == {} and v.links == []
    assert v.nodes[0]["intra_gbps"] is None and v.nodes[0]["inter_gbps"] is None
    assert any("one rank per node" in s for s in v.skipped) and any("one node" in s for s in v.skipped)


@pytest.mark.parametrize("n", range(1, 10))
def test_ring_rounds_cover_every_neighbour_pair_once_with_disjoint_pairs(n):
    rounds = ring_rounds(n)
    if n < 3:
        assert rounds == []
        return
    pairs = [pair for r in rounds for pair in r]
    assert sorted(pairs) == sorted((k, (k + 1) % n) for k in range(n))
    assert len(rounds) == (2 if n % 2 == 0 else 3)
    for r in rounds:
        nodes = [x for pair in r for x in pair]
        assert len(nodes) == len(set(nodes))


def test_nodes_sharing_a_host_take_turns():
    topo = Topology(6, 2)
    assert host_turns(("h",) * 6, topo) == [0, 1, 2]  # simulated nodes: one at a time
    assert host_turns(("a", "a", "b", "b", "c", "c"), topo) == [0, 0, 0]  # a real cluster: all at once
    assert host_turns(("a", "a", "a", "a", "b", "b"), topo) == [0, 1, 0]


def test_preflight_config():
    cfg = load_config("tiny")
    assert (cfg.monitor.preflight, cfg.monitor.preflight_margin, cfg.monitor.preflight_mib) == ("warn", 0.5, 0.0)
    assert load_config("tiny", ["monitor.preflight=exclude"]).monitor.preflight == "exclude"
    assert load_config("tiny", ["monitor.preflight=off"]).monitor.preflight is False  # YAML 1.1 reads a bare off
    for override, needle in [
        ("monitor.preflight_margin=1", "'monitor.preflight_margin': must be in (0, 1), got 1"),
        ("monitor.preflight_margin=0", "'monitor.preflight_margin': must be in (0, 1), got 0"),
        ("monitor.preflight_mib=1000", "'monitor.preflight_mib': must be between 0 (auto) and 256"),
        ("monitor.preflight=maybe", "'monitor.preflight'"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config("tiny", [override])
        assert needle in str(info.value), str(info.value)
    # Checked against the job shape: one node has no other node to be compared with, or to be left out for.
    with pytest.raises(ConfigError) as info:
        load_config("tiny", ["monitor.preflight=exclude", "job.nodes=1", "train.global_batch_size=16"])
    assert "exclude needs job.nodes >= 2" in str(info.value)
    assert load_config("tiny", ["job.nodes=1", "train.global_batch_size=16"]).monitor.preflight == "warn"


def test_a_second_measurement_keeps_each_ranks_better_figures():
    slow = {"intra_gbps": 0.3, "intra_latency_us": 900.0}
    first, second = rank_figures(4, 2, r2=slow, r3=slow), rank_figures(4, 2)
    second[0].update(compute_gflops=40.0, data_read_s=0.5, links={1: 2.0})
    first[0]["links"] = {1: 3.0, 3: 1.0}
    second[1].update(data_error="OSError: gone")
    merged = [better_of(a, b) for a, b in zip(first, second, strict=True)]
    assert merged[2]["intra_gbps"] == 1.0 and merged[2]["intra_latency_us"] == 200.0  # the second was the better
    assert merged[0]["compute_gflops"] == 100.0 and merged[0]["data_read_s"] == 0.001  # the first was the better
    assert merged[0]["links"] == {1: 3.0, 3: 1.0} and merged[0]["seconds"] == pytest.approx(0.4)
    assert merged[1]["data_error"] == "OSError: gone"  # the second read's outcome counts
    assert better_of(second[1], first[1])["data_error"] is None  # read the second time: readable
    assert list(judge(first, ranks_per_node=2, margin=0.5).named) == [1]
    assert list(judge(merged, ranks_per_node=2, margin=0.5).named) == [0]  # only rank 1's failed read is left
    one_node = better_of(rank_figures(2, 2)[0], {**rank_figures(2, 2)[0], "intra_gbps": None})
    assert one_node["intra_gbps"] == 1.0 and "inter_gbps" not in one_node  # a figure one measurement lacks stays
