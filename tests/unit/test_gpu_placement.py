"""Two ranks on one GPU are named before NCCL refuses them (trainer/parallel/distributed.py; the GPU run of
bench/gpu_check.py shows the message end to end)."""

from trainer.parallel.distributed import shared_gpus


def test_ranks_on_distinct_gpus_pass():
    # Slurm's GPU binding: every rank sees its own GPU as device 0; the identities differ, so nothing is shared
    assert shared_gpus([("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-a"), ("n2", "GPU-c")]) == []


def test_a_shared_gpu_names_both_ranks_and_the_host():
    placements = [("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-c"), ("n2", "GPU-c"), ("n2", "GPU-c")]
    assert shared_gpus(placements) == [(3, 2, "n2"), (4, 2, "n2")]
