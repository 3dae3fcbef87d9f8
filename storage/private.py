"""The user's own folders in places others reach (a node cache on a shared scratch disk, the data cache's
downloads): made 0700; an existing one used only when it is the user's, is no link, and no one else may write it
(torch-free). Its parent may be shared (``/scratch``) only with the sticky bit, which keeps others from renaming
the user's folder away and putting theirs in its place."""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from pathlib import Path


class UnsafeFolder(ValueError):
    """A folder that another user made or may write; the message names it and its owner."""


def user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def private_dir(path: Path, *, what: str, readable: bool = False) -> Path:
    """``path`` as a folder of this user's that no one else may enter (``readable``: may read, 0755, for a file
    another user's service reads, as Prometheus does its targets): the missing folders on the way made so. Refused
    (``UnsafeFolder``) when it is a link, another user's, or writable by others, or when the folder holding it is
    another user's (root's excepted) or may be written by anyone without the sticky bit; one of the user's that
    others may only read is made 0700 unless ``readable``."""
    mode = 0o755 if readable else 0o700
    path = Path(path)
    missing = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    me = os.geteuid()
    holder = path.parent if not missing else probe  # the folder that holds this user's first folder
    hst = os.stat(holder)
    if hst.st_uid not in (me, 0):
        raise UnsafeFolder(
            f"{what} {path}: the folder holding it, {holder}, belongs to {user_name(hst.st_uid)}, who could replace "
            "anything in it: choose a folder of your own."
        )
    if hst.st_mode & 0o002 and not hst.st_mode & stat.S_ISVTX:
        raise UnsafeFolder(
            f"{what} {path}: the folder holding it, {holder}, may be written by anyone and has no sticky bit, so "
            "anyone can replace what is in it; choose a folder of your own (or ask for the sticky bit, as /tmp and "
            "/scratch have)."
        )
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile: checked below as any existing folder is
            folder.mkdir(mode=mode)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolder(f"{what} {path} is not a folder but a link or a file: refused, nothing read from it.")
    if st.st_uid != me:
        raise UnsafeFolder(
            f"{what} {path} belongs to {user_name(st.st_uid)}, not to you ({user_name(me)}): another user's folder "
            "is never used (it may hold files they put there); choose a folder of your own."
        )
    if st.st_mode & 0o022:
        raise UnsafeFolder(
            f"{what} {path} may be written by others (mode {stat.S_IMODE(st.st_mode):o}): refused, nothing read "
            f"from it; remove it or make it private (chmod 700 {path})."
        )
    if stat.S_IMODE(st.st_mode) & ~mode & 0o777:
        os.chmod(path, mode)
    return path
