"""bench/checkpoint.py's view inside the checkpointer: timing wrappers around the functions that
trainer/checkpoint/'s modules call, summed per phase (bench/README.md)."""

from __future__ import annotations

import functools
import threading
import time
import types
from typing import Any


class Phases:
    """Seconds spent in wrapped functions, per phase; calls on the checkpoint thread are prefixed ``bg:``.

    A wrapped function calling itself (or another call of the same phase) counts once, at the outermost call.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = {}
        self.local = threading.local()

    def reset(self) -> dict[str, float]:
        with self.lock:
            out, self.seconds = self.seconds, {}
        return out

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:  # the checkpointer's code has moved: instrument() must follow it
            name = getattr(owner, "__name__", type(owner).__name__)
            raise RuntimeError(
                f"bench/checkpoint_phases.py: {name} has no {attr} to time as {phase}; update instrument()"
            )

        @functools.wraps(fn)
        def timed(*a: Any, **kw: Any) -> Any:
            active: set[str] = self.local.__dict__.setdefault("active", set())
            if phase in active:
                return fn(*a, **kw)
            active.add(phase)
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                elapsed = time.perf_counter() - start
                active.discard(phase)
                key = ("bg:" if threading.current_thread().name.startswith("ckpt") else "") + phase
                with self.lock:
                    self.seconds[key] = self.seconds.get(key, 0.0) + elapsed

        setattr(owner, attr, timed)


def instrument(phases: Phases) -> None:
    """Wrap what the checkpointer's modules call (their module globals only; torch itself is not patched): the
    facade trainer.checkpoint.checkpointer (the state dict, the CPU copy of an async save, a sharded model's
    fingerprint), writer.py (DCP's save, the digests, fsyncs, commit, prune), reader.py (verification, DCP's load,
    set_state_dict) and the ranks' agreement on every phase (agreement.py)."""
    import torch.distributed.checkpoint as dcp

    import rundir.checkpoints as layout
    import trainer.checkpoint.agreement as agreement
    import trainer.checkpoint.checkpointer as ck
    import trainer.checkpoint.reader as reader
    import trainer.checkpoint.writer as writer

    for module in (writer, reader):  # their own copy of torch.distributed.checkpoint's names, to wrap in place
        module.dcp = types.SimpleNamespace(**{k: getattr(dcp, k) for k in dir(dcp) if not k.startswith("_")})
    for owner, attr, phase in [
        (writer.dcp, "save", "dcp_save"),
        (reader.dcp, "load", "dcp_load"),
        (ck, "get_state_dict", "get_state_dict"),
        (reader, "get_state_dict", "get_state_dict"),
        (ck, "stage", "stage_cpu_copy"),
        (ck, "params_sha256", "params_sha256"),
        (writer, "tensors_sha256", "params_sha256"),
        (reader, "params_sha256", "params_sha256"),
        (writer, "sha256_file", "sha256_files"),
        (writer, "fsync_all_dirs", "fsync_dirs"),
        (writer, "commit", "commit_manifest"),
        (writer, "prune", "prune"),
        (reader, "set_state_dict", "set_state_dict"),
        (reader, "sha256_file", "sha256_verify"),  # each rank's share of the files, on restore
        (layout, "sha256_file", "sha256_verify"),  # validate() on restore
        (agreement.Agreement, "gather", "agree_collective"),
        (agreement.Agreement, "from_rank0", "agree_collective"),
    ]:
        phases.wrap(owner, attr, phase)
