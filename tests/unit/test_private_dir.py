"""storage/private.py: the user's own folders in shared places, made 0700; another user's, a link, one others may
write, or one under a world-writable parent without the sticky bit refused with a message naming it."""

from __future__ import annotations

import pytest

from storage.private import UnsafeFolder, private_dir
from tests.conftest import as_user


def mode(path) -> int:
    return path.stat().st_mode & 0o7777


def test_missing_folders_are_made_private_and_a_readable_one_is_tightened(tmp_path):
    folder = private_dir(tmp_path / "a" / "b", what="the cache")
    assert mode(tmp_path / "a") == mode(folder) == 0o700
    (tmp_path / "c").mkdir(mode=0o755)
    assert mode(private_dir(tmp_path / "c", what="the cache")) == 0o700


def test_a_link_a_writable_folder_or_an_open_parent_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafeFolder, match=f"the cache {tmp_path}/link is not a folder but a link"):
        private_dir(tmp_path / "link", what="the cache")
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(UnsafeFolder, match="may be written by others \\(mode 777\\).*chmod 700"):
        private_dir(tmp_path / "open", what="the cache")
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch").chmod(0o777)  # world-writable without the sticky bit: anyone can swap the folder
    with pytest.raises(UnsafeFolder, match="holding it, .*/scratch, may be written by anyone"):
        private_dir(tmp_path / "scratch" / "mine", what="the cache")
    (tmp_path / "scratch").chmod(0o1777)
    assert mode(private_dir(tmp_path / "scratch" / "mine", what="the cache")) == 0o700


def test_another_users_folder_is_refused_naming_them(other_user, shared_scratch):
    theirs = shared_scratch / "node0"
    assert as_user(other_user, ["mkdir", "-m", "700", str(theirs)]).returncode == 0
    who = f"{other_user.pw_name} \\(uid {other_user.pw_uid}\\)"
    with pytest.raises(UnsafeFolder, match=f"the cache {theirs} belongs to {who}, not to you"):
        private_dir(theirs, what="the cache")
    with pytest.raises(UnsafeFolder, match=f"the folder holding it, {theirs}, belongs to {who}"):
        private_dir(theirs / "key", what="the cache")
    assert not (theirs / "key").exists()
