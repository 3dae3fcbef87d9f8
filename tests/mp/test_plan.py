"""The memory plan (python -m trainer.plan) at 4,096 ranks; against real runs' peaks: tests/bench's memory_plan."""

from __future__ import annotations

import json

from tests.conftest import run_cli

MODEL = ["model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.seq_len=32", "train.micro_batch_size=4"]


def planned(small_dataset, extra: list[str], nodes: int, per_node: int) -> dict:
    sets = [a for kv in [f"data.path={small_dataset}", *MODEL, *extra] for a in ("--set", kv)]
    where = ["--nodes", str(nodes), "--ranks-per-node", str(per_node)]
    done = run_cli(["-m", "trainer.plan", "tiny", *sets, *where, "--json"])
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_the_plan_of_4096_ranks(small_dataset):
    """512 nodes x 8 ranks, planned on this machine without a GPU. DDP: every rank holds the whole model, its
    gradients' buckets and AdamW's two moments. TP 8 x HSDP 128 x 4: a rank holds at least 1/32 of that state (the
    split matrices' share), less than 1/8 (the embeddings are split by FSDP2 alone). A 1F1B pipeline of 4 stages
    beside HSDP 4 x 256: one plan per stage, each holding a part of the model."""
    ddp = planned(small_dataset, ["train.global_batch_size=16384"], 512, 8)
    assert ddp["world_size"] == 4096 and ddp["layout"] == "pp 1 x dp_replicate 4096 x dp_shard 1 x cp 1 x tp 1", ddp
    (whole,) = ddp["ranks"]
    assert whole["params"] > 40e6 and whole["comm"] == whole["params"]  # 12.7M fp32 parameters
    assert 0 <= whole["optimizer"] - 2 * whole["params"] < 4096  # the moments, and a step count per tensor
    assert whole["peak"] >= sum(whole[k] for k in ("params", "optimizer", "comm"))

    big = planned(small_dataset, ["parallel.tp=8", "parallel.dp_shard=4", "train.global_batch_size=2048"], 512, 8)
    assert big["layout"] == "pp 1 x dp_replicate 128 x dp_shard 4 x cp 1 x tp 8", big
    (rank,) = big["ranks"]
    for kind in ("params", "optimizer"):
        assert whole[kind] / 32 <= rank[kind] < whole[kind] / 8, (kind, rank[kind], whole[kind])

    pp = planned(small_dataset, ["parallel.pp=4", "parallel.dp_replicate=4", "parallel.dp_shard=256",
                                 "train.global_batch_size=4096", "train.eval_sequences=4096"], 512, 8)  # fmt: skip
    assert pp["layout"] == "pp 4 x dp_replicate 4 x dp_shard 256 x cp 1 x tp 1", pp
    assert [r["pp"] for r in pp["ranks"]] == [0, 1, 2, 3] and [r["rank"] for r in pp["ranks"]] == [0, 1024, 2048, 3072]
    for r in pp["ranks"]:  # a stage's parameters stay gathered through the schedule; its AdamW state is sharded
        assert 0 < r["params"] < whole["params"] / 2 and 0 < r["optimizer"] < whole["optimizer"] / 256, r


def test_the_plan_under_context_parallelism(small_dataset):
    """cp 2 x 2 replicas against HSDP 2 x 2 (the same FSDP2 shard degree, one micro-batch a step): the same state
    per rank, and the activations of half of every sequence (the ring's whole-sequence keys and values, and its
    float32 merge, keep them above half)."""
    cp = planned(small_dataset, ["parallel.cp=2", "train.global_batch_size=8"], 2, 2)
    hsdp = planned(small_dataset, ["parallel.dp_shard=2", "train.global_batch_size=16"], 2, 2)
    assert cp["layout"] == "pp 1 x dp_replicate 2 x dp_shard 1 x cp 2 x tp 1", cp
    (a,), (b,) = cp["ranks"], hsdp["ranks"]
    assert a["params"] == b["params"] and a["optimizer"] == b["optimizer"], (a, b)
    assert 0.5 * b["activations"] < a["activations"] < 0.8 * b["activations"], (a, b)


def test_the_plan_of_two_stages_a_rank_beside_tensor_parallelism(small_dataset):
    """Interleaved 1F1B of 2 stages a rank x TP 2: both pipeline coordinates planned (each in a process of its own,
    its stages' inputs split as TP splits them). A rank's AdamW moments are twice its parameters (no sharding beside
    TP)."""
    extra = ["parallel.pp=2", "parallel.pp_stages_per_rank=2", "parallel.pp_schedule=Interleaved1F1B", "parallel.tp=2"]
    got = planned(small_dataset, [*extra, "train.global_batch_size=8"], 2, 2)
    assert got["layout"] == "pp 2 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 2", got
    assert [r["pp"] for r in got["ranks"]] == [0, 1] and [r["rank"] for r in got["ranks"]] == [0, 2], got
    for r in got["ranks"]:
        assert 0 <= r["optimizer"] - 2 * r["params"] < 4096 and r["activations"] > 0, r
