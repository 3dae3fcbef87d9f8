"""The parallel layout: degrees resolved against the job's shape, placement on the ranks, and every impossible
layout refused by the config loader (before any process starts) naming the key."""

import pytest

from runconfig import ConfigError, from_dict
from runconfig.layout import Layout, LayoutError, resolve


def degrees(pp=1, dp_replicate=-1, dp_shard=1, tp=1) -> dict:
    return {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}


def test_defaults_are_ddp_over_every_rank():
    layout = resolve(degrees(), 8, 4)
    assert layout == Layout(dp_replicate=8) and layout.kind == "ddp" and layout.dp == 8 and not layout.sharded
    assert not layout.uses_mesh  # DDP


@pytest.mark.parametrize(
    ("layout", "sharded", "uses_mesh"),
    [
        (Layout(dp_shard=4), True, True),
        (Layout(dp_replicate=2, tp=2), True, True),
        (Layout(pp=2, dp_replicate=2), False, True),  # stages: a collective forward, but whole parameters
        (Layout(dp_replicate=4), False, False),
    ],
)
def test_sharded_and_the_mesh_path(layout, sharded, uses_mesh):
    assert (layout.sharded, layout.uses_mesh) == (sharded, uses_mesh)


@pytest.mark.parametrize(
    ("given", "want", "kind"),
    [
        (degrees(dp_replicate=1, dp_shard=-1), Layout(dp_shard=4), "fsdp"),
        (degrees(dp_shard=2), Layout(dp_replicate=2, dp_shard=2), "hsdp"),
        (degrees(dp_replicate=2, dp_shard=-1), Layout(dp_replicate=2, dp_shard=2), "hsdp"),
    ],
)
def test_minus_one_takes_what_is_left(given, want, kind):
    layout = resolve(given, 4, 2)
    assert layout == want and layout.kind == kind and layout.world_size == 4


def test_placement_keeps_inner_dimensions_inside_a_node():
    """HSDP on 2 nodes x 2: the shard groups are the nodes, the replicas pair the same local rank across nodes;
    the data-parallel rank of every rank is distinct."""
    layout = Layout(dp_replicate=2, dp_shard=2)
    coords = [layout.coords(r) for r in range(4)]
    assert [c["dp_replicate"] for c in coords] == [0, 0, 1, 1]  # node index
    assert [c["dp_shard"] for c in coords] == [0, 1, 0, 1]  # local index
    assert sorted(layout.dp_rank(r) for r in range(4)) == [0, 1, 2, 3]
    tp = Layout(dp_replicate=2, tp=2)
    assert [tp.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1] and tp.dp_rank(1) == tp.dp_rank(0) == 0


@pytest.mark.parametrize(
    ("given", "world", "per_node", "key", "words"),
    [
        (degrees(dp_replicate=1, dp_shard=3), 4, 2, "dp_shard", "3 ranks, but the job has 4"),
        (degrees(dp_replicate=2, dp_shard=4), 4, 4, "dp_shard", "8 ranks, but the job has 4"),
        (degrees(dp_replicate=1, dp_shard=2, tp=2), 8, 4, "tp", "4 ranks, but the job has 8"),
        (degrees(dp_replicate=-1, dp_shard=-1), 4, 2, "dp_shard", "only one degree may be -1"),
        (degrees(dp_shard=3), 4, 2, "dp_shard", "multiply to 3, which does not divide 4"),
        (degrees(tp=3), 6, 2, "tp", "3 does not divide the 2 ranks of a node"),  # the degree set, not the remainder
        (degrees(tp=3), 4, 2, "tp", "3 does not divide the 2 ranks of a node"),
        (degrees(dp_shard=0), 4, 2, "dp_shard", "must be >= 1"),
        (degrees(tp=4, dp_replicate=1), 4, 2, "tp", "does not divide the 2 ranks of a node"),
    ],
)
def test_impossible_layouts_name_the_key(given, world, per_node, key, words):
    with pytest.raises(LayoutError) as err:
        resolve(given, world, per_node)
    assert err.value.key == key and words in str(err.value)


def raw(**parallel) -> dict:
    return {"job": {"nodes": 2, "ranks_per_node": 2}, "train": {"global_batch_size": 8, "micro_batch_size": 2},
            "parallel": parallel}  # fmt: skip


@pytest.mark.parametrize(
    ("parallel", "words"),
    [
        ({"dp_shard": 3}, "key 'parallel.dp_shard': -1 takes what is left of the 4 ranks"),
        ({"dp_replicate": 1, "dp_shard": 8}, "key 'parallel.dp_shard': pp 1 x dp_replicate 1 x dp_shard 8"),
        ({"dp_replicate": -1, "dp_shard": -1}, "key 'parallel.dp_shard': only one degree may be -1"),
        ({"pp": 3}, "key 'parallel.pp': -1 takes what is left of the 4 ranks"),
        ({"tp": 4}, "key 'parallel.tp': 4 does not divide the 2 ranks of a node"),
        ({"tp": 3}, "key 'parallel.tp': 3 does not divide the 2 ranks of a node"),
        ({"dp_shard": -2}, "key 'parallel.dp_shard': must be >= 1, or -1"),
        ({"activation_checkpointing": "some"}, "parallel.activation_checkpointing"),
    ],
)
def test_config_refuses_impossible_layouts(parallel, words):
    with pytest.raises(ConfigError) as err:
        from_dict(raw(**parallel), source="cfg.yaml")
    assert "config cfg.yaml" in str(err.value) and words in str(err.value)


def test_a_smaller_world_after_a_node_is_left_out_must_fit_the_layout():
    """min_nodes lets the run continue on fewer nodes: the layout must resolve there too (a -1 degree adapts)."""
    cfg = {**raw(dp_replicate=2, dp_shard=2), "job": {"nodes": 2, "ranks_per_node": 2, "min_nodes": 1}}
    with pytest.raises(ConfigError) as err:
        from_dict(cfg, source="cfg.yaml")
    assert "key 'job.min_nodes': on 1 of job.nodes=2" in str(err.value)
    adapts = {**raw(dp_shard=2), "job": {"nodes": 2, "ranks_per_node": 2, "min_nodes": 1}}
    assert from_dict(adapts).layout(2) == Layout(dp_replicate=1, dp_shard=2)


def test_the_global_batch_splits_over_the_data_parallel_ranks():
    cfg = from_dict(raw(dp_shard=2))
    assert cfg.layout().dp == 4 and cfg.grad_accum() == cfg.grad_accum(4) == 1
    with pytest.raises(ConfigError) as err:
        from_dict({**raw(dp_shard=2), "train": {"global_batch_size": 6, "micro_batch_size": 2}}, source="c.yaml")
    assert "key 'train.global_batch_size': 6 is not a multiple of train.micro_batch_size (2) x world size" in str(
        err.value
    )


def test_tensor_parallel_layouts():
    """tp innermost: the ranks of a node form a group, the nodes are replicas; the built-in GPT's heads and MLP
    units must split evenly (the config knows its shape); another recipe's model is checked at start-up."""
    cfg = from_dict(raw(tp=2))
    layout = cfg.layout()
    assert layout == Layout(dp_replicate=2, tp=2) and layout.sharded and layout.dp == 2 and layout.kind == "ddp+tp"
    # The global batch splits over the 2 data-parallel ranks only: tensor-parallel peers share a micro-batch.
    assert cfg.grad_accum() == cfg.grad_accum(4) == 2
    assert from_dict(raw(tp=2, pp=2, dp_replicate=1)).grad_accum() == 4  # 4 ranks, 1 data-parallel rank
    assert from_dict(raw(tp=2, dp_shard=2, dp_replicate=1)).layout().kind == "fsdp+tp"
    odd = {**raw(tp=2), "model": {"d_model": 96, "n_heads": 3}}
    with pytest.raises(ConfigError) as err:
        from_dict(odd, source="cfg.yaml")
    assert "key 'parallel.tp': 2 does not divide model.n_heads = 3" in str(err.value)
    other = {**raw(tp=2), "recipe": "mypkg.recipes:model", "recipe_args": {"heads": 3}}
    assert from_dict(other).layout().tp == 2


@pytest.mark.parametrize(
    ("parallel", "extra", "words"),
    [
        ({"pp": 2, "pp_microbatches": 1}, {}, "key 'parallel.pp_microbatches': 1 is fewer than the 2 pipeline stages"),
        ({"pp": 2, "pp_microbatches": 3}, {}, "key 'parallel.pp_microbatches': 3 pipeline micro-batches do not divide"),
        ({"pp": 2}, {"model": {"n_layers": 1}}, "key 'parallel.pp': 2 stages for model.n_layers=1"),
        ({"pp": 2}, {"train": {"global_batch_size": 8, "micro_batch_size": 2, "eval_sequences": 3}}, "eval_sequences"),
        ({"pp": 2, "pp_schedule": "zb"}, {}, "parallel.pp_schedule"),
        ({"pp": 2, "pp_stages_per_rank": 2}, {}, "pp_stages_per_rank': 2 stages per rank need an interleaved"),
        ({"pp": 2, "pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 3}, {}, "places exactly 2 stages on each"),
        ({"pp": 2, "pp_schedule": "Interleaved1F1B"}, {}, "interleaves 2 or more stages on each rank; this config"),
        (
            {"pp": 2, "pp_schedule": "DualPipeV", "pp_stages_per_rank": 2},
            {},
            "'parallel.pp_microbatches': 2 is fewer than DualPipeV's 2 x pp = 4",
        ),
        (
            {"pp": 2, "pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 2, "pp_microbatches": 5},
            {},
            "'parallel.pp_microbatches': 5 is not a multiple of the 2 rounds",
        ),
        (
            {"pp": 2, "pp_schedule": "InterleavedZeroBubble", "pp_stages_per_rank": 2, "compile": True},
            {},
            "key 'parallel.compile': parallel.pp_schedule=InterleavedZeroBubble splits each backward",
        ),
        (
            {"pp": 2, "pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 2},
            {},
            "'parallel.pp_stages_per_rank': 4 stages for model.n_layers=2",
        ),
        ({"pp_stages_per_rank": 2}, {}, "key 'parallel.pp_stages_per_rank': stages per rank cut a pipeline"),
    ],
)
def test_pipeline_layouts_refused(parallel, extra, words):
    with pytest.raises(ConfigError) as err:
        from_dict({**raw(**parallel), "model": {"n_layers": 2}, **extra}, source="cfg.yaml")
    assert words in str(err.value)


@pytest.mark.parametrize(
    ("parallel", "words"),
    [
        ({"offload": True}, "key 'parallel.offload': host offload moves FSDP2's shards, and the ddp layout"),
        ({"offload": True, "tp": 2}, "ddp+tp layout (pp 1 x dp_replicate 2 x dp_shard 1 x cp 1 x tp 2) shards nothing"),
        ({"loss_parallel": True, "dp_shard": 2}, "'parallel.loss_parallel': the logits are split over a tensor-"),
    ],
)
def test_offload_and_loss_parallel_need_their_dimension(parallel, words):
    with pytest.raises(ConfigError) as err:
        from_dict(raw(**parallel), source="cfg.yaml")
    assert words in str(err.value)
    from_dict(raw(**{**parallel, "dp_shard": 2, "tp": 2}), source="cfg.yaml")  # with it: accepted


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"model": {"doc_mask": True}}, "key 'parallel.cp': context parallelism runs torch's causal ring attention"),
        ({"parallel": {"cp": 2, "pp": 2}}, "key 'parallel.cp': context parallelism beside pipeline stages"),
        ({"model": {"seq_len": 66}}, "key 'parallel.cp': model.seq_len=66 is not a multiple of 2 x cp = 4"),
        ({"model": {"dropout": 0.1}}, "key 'parallel.cp': torch's ring attention takes no attention dropout"),
        ({"data": {"bucket_by_length": True}}, "key 'parallel.cp': data.bucket_by_length makes batches of other"),
        # -1 degrees are resolved first: pp takes the 2 ranks cp leaves
        ({"parallel": {"cp": 2, "pp": -1, "dp_replicate": 1}}, "context parallelism beside pipeline stages (pp 2 x"),
    ],
)
def test_context_parallel_refusals_name_the_key(extra, words):
    with pytest.raises(ConfigError) as err:
        from_dict({**raw(cp=2), **extra}, source="cfg.yaml")
    assert words in str(err.value)
    layout = from_dict({**raw(cp=2), "model": {"seq_len": 64}}, source="cfg.yaml").layout(4)
    assert (layout.dp_replicate, layout.cp, layout.fsdp, layout.kind) == (2, 2, 2, "hsdp+cp")
    assert layout.coords(3) == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "cp": 1, "tp": 0}
    assert [layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]  # a cp group reads one share of the data


def test_pipeline_layout():
    """pp outermost: the stages are the nodes; the ranks of a node are the replicas of a stage."""
    layout = from_dict({**raw(pp=2), "model": {"n_layers": 2}}).layout()
    assert layout == Layout(pp=2, dp_replicate=2) and layout.dp == 2 and layout.kind == "ddp+pp"
    assert [layout.coords(r)["pp"] for r in range(4)] == [0, 0, 1, 1]
    assert [layout.dp_rank(r) for r in range(4)] == [0, 1, 0, 1]


def test_gradient_compression_is_ddps_and_refused_under_fsdp2():
    ok = from_dict({**raw(), "comm": {"compress": "bf16"}}, source="cfg.yaml")
    assert ok.comm.compress == "bf16"
    with pytest.raises(ConfigError) as err:
        from_dict({**raw(dp_shard=2), "comm": {"compress": "bf16"}}, source="cfg.yaml")
    assert "key 'comm.compress': bf16 compresses DDP's gradient all-reduce; the hsdp layout" in str(err.value)
    with pytest.raises(ConfigError, match="comm.compress"):
        from_dict({**raw(), "comm": {"compress": "fp8"}}, source="cfg.yaml")


def test_chunk_size_of_the_pipelined_all_reduce():
    assert from_dict({**raw(), "comm": {"chunk_kb": 1024}}, source="cfg.yaml").comm.chunk_kb == 1024
    with pytest.raises(ConfigError, match="comm.chunk_kb': must be >= 0"):
        from_dict({**raw(), "comm": {"chunk_kb": -1}}, source="cfg.yaml")
