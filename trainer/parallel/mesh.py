"""The training DeviceMesh of a parallel layout (runconfig/layout.py): one dimension per degree above 1, in the
layout's order (pp, dp_replicate, dp_shard, cp, tp), over the global ranks in order, so that inner dimensions stay
inside a node. Built once per launch, after the (node, local) groups of trainer.parallel.distributed; every rank
builds it in the same order."""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from runconfig.layout import DIMS, Layout


def train_mesh(layout: Layout, device: torch.device) -> DeviceMesh | None:
    """The mesh of the layout's dimensions above 1 (dp_shard always); None for plain DDP."""
    if not layout.uses_mesh:
        return None
    names = [n for n in DIMS if getattr(layout, n) > 1 or n == "dp_shard"]
    return init_device_mesh(device.type, tuple(getattr(layout, n) for n in names), mesh_dim_names=tuple(names))


def dp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The data-parallel part FSDP2 shards over: (dp_replicate, dp_shard) for HSDP, else dp_shard; with context
    parallelism dp_shard x cp flattened into one dimension (torchtitan's dp_shard_cp): the cp ranks hold the same
    parameters, and their gradients are summed with the shards'."""
    shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp") if layout.cp > 1 else mesh["dp_shard"]
    if layout.dp_replicate == 1:
        return shard
    if layout.cp == 1:
        return mesh["dp_replicate", "dp_shard"]
    with warnings.catch_warnings():  # torch 2.13 warns of a future change to slicing a flattened dimension
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh["dp_replicate", "dp_shard_cp"]
