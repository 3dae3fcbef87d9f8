"""DDP's gradient bucket sizes from ``comm.bucket_mb`` and ``comm.first_bucket_mb``.

DDP gives its first bucket (the gradients backward produces first, reduced while backward goes on) a 1 MiB cap only
when it is given no bucket size at all; a ``bucket_cap_mb`` makes every bucket that size, so the reduction of a model
smaller than one bucket cannot start before backward ends. torch's ``bucket_cap_mb_list`` (per-bucket caps, the last
one repeating) keeps both: a small first bucket and the configured size after it."""

from __future__ import annotations

import inspect
import logging

from torch.nn.parallel import DistributedDataParallel as DDP

from runconfig.schema import CommConfig

log = logging.getLogger(__name__)

DDP_DEFAULT = (1.0, 25.0)  # DDP's own first-bucket and bucket caps (MiB) when it is given no size


def ddp_bucket_caps(comm: CommConfig, *, per_bucket: bool | None = None) -> dict:
    """Keyword arguments of ``DistributedDataParallel`` for the configured caps. ``per_bucket``: whether this torch's
    DDP takes ``bucket_cap_mb_list`` (None: look). Without it a first bucket smaller than the rest is kept only at
    DDP's own default sizes; otherwise every bucket is ``bucket_mb`` (logged)."""
    first, rest = comm.first_bucket_mb, comm.bucket_mb
    if first >= rest:
        return {"bucket_cap_mb": rest}
    if per_bucket is None:
        per_bucket = "bucket_cap_mb_list" in inspect.signature(DDP.__init__).parameters
    if per_bucket:
        return {"bucket_cap_mb_list": [first, rest]}
    if (first, rest) == DDP_DEFAULT:
        return {"bucket_cap_mb": None}
    log.warning(
        "comm.first_bucket_mb=%g: this torch's DDP takes one bucket size (no bucket_cap_mb_list): every bucket is "
        "comm.bucket_mb=%g MB",
        first,
        rest,
    )
    return {"bucket_cap_mb": rest}


def ddp_bucket_bytes(ddp: DDP) -> list[int]:
    """The bytes of each of DDP's gradient buckets in its current layout (after the first backward DDP rebuilds
    them in gradient-ready order, at the next forward). Allocates a zeroed copy of the buckets for the moment: call
    it once, with the gradients freed (before the optimizer's state exists, the step's peak is well above it)."""
    return [b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets()]
