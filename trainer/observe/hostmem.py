"""The host allocator's hold on freed memory (glibc malloc): ``train.host_mmap_threshold_kb``, set once per rank.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with a mapping of its own, returned to the OS when
freed; smaller ones come from the heap, whose freed space stays resident. The threshold starts at 128 KiB but is
*dynamic*: the first free of a mapped block raises it to that block's size (up to 32 MiB). From then on tensors of
a few MB (activations, FSDP's all-gathered parameters and reduce-scatter buffers, gloo's staging) live in the heap,
fragmented, and the process keeps what they took. Fixing the threshold (``mallopt``, which also switches the raise
off) hands that memory back, at the price of a mapping and zero-filled page faults for every large allocation:
measured on CPU, it lowers the peak per rank (most under FSDP) and costs throughput too
(docs/measurements/parallel.md, "host memory"). So the default leaves glibc alone; a run short of host memory sets it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>


def fix_mmap_threshold(kib: int) -> bool:
    """Serve host allocations of ``kib`` KiB or more from their own mappings, for good (0: leave glibc's dynamic
    default). Returns whether it was applied: False where the C library is not glibc (musl, macOS)."""
    if kib <= 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.info("train.host_mmap_threshold_kb: this C library has no mallopt; left as it is")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, kib * 1024))
