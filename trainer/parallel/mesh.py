"""The training DeviceMesh of a parallel layout (runconfig/layout.py): one dimension per degree above 1, in the
layout's order (pp, dp_replicate, dp_shard, tp), over the global ranks in order, so that inner dimensions stay
inside a node. Built once per launch, after the (node, local) groups of trainer.parallel.distributed; every rank
builds it in the same order."""

from __future__ import annotations

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
    """The data-parallel part FSDP2 shards over: (dp_replicate, dp_shard) for HSDP, else dp_shard."""
    return mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
