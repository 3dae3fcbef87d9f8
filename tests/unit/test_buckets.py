"""DDP's buckets from comm.bucket_mb and comm.first_bucket_mb: by default a small first bucket (DDP's own 1 MiB, which
it drops as soon as it is given a bucket size) and the configured size after it, so a model smaller than one bucket
still starts reducing before backward ends."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from runconfig.schema import CommConfig
from trainer.parallel.grad_buckets import ddp_bucket_caps

LAYER_BYTES = (256 * 256 + 256) * 4


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def bucket_sizes(comm: CommConfig) -> list[int]:
    """The bucket sizes (bytes) DDP forms for 10 layers of 257 KiB (2.5 MiB) under ``comm``'s caps."""
    ddp = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(10)]), **ddp_bucket_caps(comm))
    for _ in range(2):  # buckets are rebuilt in the order gradients arrive after the first backward
        ddp(torch.randn(4, 256)).sum().backward()
    return sorted(int(s) for s in str(ddp._get_ddp_logging_data()["bucket_sizes"]).split(","))


def test_the_default_first_bucket_is_small_and_the_rest_one_bucket(group):
    sizes = bucket_sizes(CommConfig())
    assert sum(sizes) == 10 * LAYER_BYTES
    assert len(sizes) == 2 and sizes[0] <= (1 << 20) + LAYER_BYTES, sizes


def test_a_first_bucket_as_large_as_the_rest_gives_one_bucket(group):
    assert bucket_sizes(CommConfig(first_bucket_mb=25.0)) == [10 * LAYER_BYTES]


def test_smaller_buckets_everywhere(group):
    sizes = bucket_sizes(dataclasses.replace(CommConfig(), bucket_mb=0.5, first_bucket_mb=0.25))
    assert sum(sizes) == 10 * LAYER_BYTES and len(sizes) >= 5, sizes


def test_without_per_bucket_caps_only_ddps_own_default_keeps_a_small_first_bucket(caplog):
    assert ddp_bucket_caps(CommConfig(), per_bucket=False) == {"bucket_cap_mb": None}
    assert ddp_bucket_caps(CommConfig(first_bucket_mb=2.0), per_bucket=False) == {"bucket_cap_mb": 25.0}
    assert "comm.first_bucket_mb=2" in caplog.text
    assert ddp_bucket_caps(CommConfig(bucket_mb=4.0, first_bucket_mb=4.0), per_bucket=True) == {"bucket_cap_mb": 4.0}
