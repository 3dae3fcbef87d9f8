"""Writing a file so that no reader sees part of it, and appending a JSON line so that no two writers interleave:
the one way every file of a run directory, a sweep, a cache or a checkpoint is written (torch-free)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: str | bytes, *, fsync: bool) -> None:
    """Replace ``path`` with ``data``: written under a name of this process and thread, then renamed, so readers see
    the old file or the new one. ``fsync``: the data reach the disk before the rename (a file another process
    trusts after a crash: a commit marker, a record of the run); without it a crash may leave the old file or an
    empty one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_native_id()}")
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(
    path: Path, data: object, *, fsync: bool = True, indent: int = 2, sort_keys: bool = False, default=None
) -> None:
    """``data`` as JSON (one trailing newline) through ``write_atomic``."""
    text = json.dumps(data, indent=indent, sort_keys=sort_keys, default=default) + "\n"
    write_atomic(path, text, fsync=fsync)


def append_jsonl(path: Path, obj: dict) -> None:
    """Append one JSON object as a line (history, jobs, rungs). One write call on a file opened for appending, so a
    line is never interleaved with another writer's."""
    with open(path, "a") as f:
        f.write(json.dumps(obj, separators=(",", ":")) + "\n")
