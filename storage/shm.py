"""Shared-memory segments that killed MPI ranks leave in /dev/shm: found and removed (torch-free).

MPICH creates ``/dev/shm/mpich_shm_<hash>_<n>`` (1-4 MB) for the ranks of a node during ``MPI_Init`` and unlinks it
once every local rank has attached. A rank killed before that (a launch killed, preempted or failing during
start-up) leaves the file behind, and nothing else ever removes it: /dev/shm is memory, and a node that runs many
short jobs fills with them. A segment is stale when no process has it open or mapped; a sweep removes this user's
stale segments and nothing else. It runs after every local launch (``hpc.local``), on each node when a launch
starts (the trainer's node-local rank 0, for whatever an earlier killed launch left there) and on every node of a
Slurm allocation after a launch that failed (``python -m hpc.shmsweep`` as one task per node).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIXES = ("mpich_shm_",)


def in_use(directory: Path = SHM_DIR, proc: Path = Path("/proc")) -> set[str]:
    """Names of the files directly under ``directory`` that a process we can inspect has open or mapped."""
    prefix = str(directory).rstrip("/") + "/"
    names: set[str] = set()

    def note(path: str) -> None:
        if path.startswith(prefix):
            names.add(path[len(prefix) :].split("/", 1)[0].removesuffix(" (deleted)"))

    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(entry / "maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6:
                        note(fields[5].rstrip("\n"))
            for fd in (entry / "fd").iterdir():
                note(os.readlink(fd))
        except OSError:  # the process ended, or is another user's (then it cannot hold our 0600 segments)
            continue
    return names


def stale(
    directory: Path = SHM_DIR, prefixes: Iterable[str] = PREFIXES, uid: int | None = None, proc: Path = Path("/proc")
) -> list[Path]:
    """This user's MPI segments in ``directory`` that no process has open or mapped."""
    uid = os.getuid() if uid is None else uid
    prefixes = tuple(prefixes)
    try:
        candidates = [p for p in directory.iterdir() if p.name.startswith(prefixes)]
    except OSError:
        return []
    owned = []
    for path in candidates:
        try:
            if path.lstat().st_uid == uid and path.is_file():
                owned.append(path)
        except OSError:
            continue
    if not owned:
        return []
    busy = in_use(directory, proc)
    return sorted(p for p in owned if p.name not in busy)


def sweep(directory: Path = SHM_DIR, prefixes: Iterable[str] = PREFIXES, proc: Path = Path("/proc")) -> list[Path]:
    """Remove this user's stale MPI segments; return the ones removed."""
    removed = []
    for path in stale(directory, prefixes, proc=proc):
        try:
            path.unlink()
            removed.append(path)
        except OSError:  # removed meanwhile by another sweep, or not ours to remove
            continue
    return removed
