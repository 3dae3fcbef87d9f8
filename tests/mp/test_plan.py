"""The memory plan (python -m trainer.plan) against a real run's peaks, at 4 local ranks, and at 4,096 ranks."""

from __future__ import annotations

import json

from tests.conftest import run_cli, summary

# A model whose state outweighs the runtime's own growth (the data, the loader, Python objects: tens of MB)
MODEL = [
    "model.d_model=1024", "model.n_layers=4", "model.n_heads=8", "model.seq_len=32", "train.micro_batch_size=1",
    "train.global_batch_size=4", "train.steps=2", "train.warmup_steps=1", "train.eval_every=0",
    # the host's resident set follows the live tensors: no full model on the host before the split, and freed
    # buffers handed back (their own mappings)
    "parallel.meta_init=true", "train.host_mmap_threshold_kb=64",
]  # fmt: skip


def sets_of(small_dataset, extra=()) -> list[str]:
    return [a for kv in [f"data.path={small_dataset}", *MODEL, *extra] for a in ("--set", kv)]


def planned(small_dataset, extra=(), nodes=None, per_node=None) -> dict:
    where = [*(["--nodes", str(nodes)] if nodes else []), *(["--ranks-per-node", str(per_node)] if per_node else [])]
    done = run_cli(["-m", "trainer.plan", "tiny", *sets_of(small_dataset, extra), *where, "--json"])
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_the_plan_meets_a_real_runs_peak_and_plans_4096_ranks(tmp_path, small_dataset):
    """DDP (torch's own all-reduce) on 2 simulated nodes x 2 ranks: each rank's measured peak (its resident set's,
    less the runtime's with the recipe built) is within 10% of the plan's. The model planned on 4,096 ranks with
    FSDP2 x TP: a rank holds 1/32 of the split matrices, less than 1/8 of the whole. Pipeline parallelism is
    refused, naming the key."""
    flat = ["comm.allreduce=flat"]
    run_dir = tmp_path / "run"
    done = run_cli(["-m", "hpc.submit", "tiny", "--local", *sets_of(small_dataset, flat), "--run-dir", str(run_dir)])
    assert done.returncode == 0, done.stdout + done.stderr
    measured = [(r["peak"] - r["runtime"]) * 2**20 for r in summary(run_dir)["memory_mb_per_rank"]]
    plan = planned(small_dataset, flat)
    assert plan["world_size"] == 4 and plan["layout"].startswith("pp 1 x dp_replicate 4")
    peak = plan["ranks"][0]["peak"]
    assert all(abs(peak - m) / m < 0.10 for m in measured), (peak / 2**20, [m / 2**20 for m in measured])
    whole = summary(run_dir)["state_bytes_per_rank"]  # DDP: every rank holds the whole model
    assert plan["ranks"][0]["params"] == whole["params"] and plan["ranks"][0]["optimizer"] == whole["optimizer"]

    big = planned(small_dataset, ["parallel.tp=8", "parallel.dp_shard=4", "train.global_batch_size=512"], 512, 8)
    assert big["world_size"] == 4096 and big["layout"] == "pp 1 x dp_replicate 128 x dp_shard 4 x tp 8", big
    rank = big["ranks"][0]
    for kind in ("params", "optimizer"):  # 1/32 of the split matrices; the embeddings split by FSDP2 alone
        assert whole[kind] / 32 <= rank[kind] < whole[kind] / 8, (kind, rank[kind], whole[kind])

    refused = run_cli(
        [
            "-m",
            "trainer.plan",
            "tiny",
            *sets_of(small_dataset, ["parallel.pp=2", "train.micro_batch_size=2", "train.global_batch_size=4"]),
        ]
    )
    assert refused.returncode == 2 and "parallel.pp=2: the memory plan does not cover" in refused.stderr
