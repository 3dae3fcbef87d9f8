"""A name read from a shared place (an object key under a URL, a file name in a downloaded manifest) made into a
local path only under its root: the one join every such name goes through (torch-free).

Refused: an empty name, an absolute one, a ``.`` or ``..`` segment, an empty segment (``a//b``), a backslash or a
NUL; then the joined path, its links resolved, must still lie under the root's (a link planted inside the root that
points out of it is refused too)."""

from __future__ import annotations

import os
from pathlib import Path


class UnsafeName(ValueError):
    """A remote name that would not stay under its local root; the message names it."""


def check_name(name: str, *, flat: bool = False) -> None:
    """Raise UnsafeName unless ``name`` is a relative path of plain segments (``flat``: a single one)."""
    problem = _problem(name, flat)
    if problem:
        raise UnsafeName(f"{name!r} {problem}")


def safe_join(root: Path, name: str, *, flat: bool = False) -> Path:
    """``root / name`` for ``name`` read from a shared place; ``flat``: a single path segment only."""
    check_name(name, flat=flat)
    path = Path(root) / name
    base = os.path.realpath(root)
    if os.path.commonpath([base, os.path.realpath(path)]) != base:
        raise UnsafeName(f"{name!r} leads out of {root} (through a link)")
    return path


def _problem(name: str, flat: bool) -> str | None:
    if not isinstance(name, str):
        return "is not a string"
    if not name:
        return "is empty"
    if "\0" in name or "\\" in name:
        return "holds a NUL or a backslash"
    if name.startswith("/"):
        return "is an absolute path"
    parts = name.split("/")
    if flat and len(parts) > 1:
        return "is not a plain file name"
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' segment"
    return None
