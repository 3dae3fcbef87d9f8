"""storage.safepath.safe_join: a name read from a shared place becomes a path only under its root."""

import os

import pytest

from storage.safepath import UnsafeName, safe_join


@pytest.mark.parametrize("name", ["train_00000.bin", "dcp/__0_0.distcp", "a/b/c.py", "..hidden", "x..y"])
def test_names_under_the_root_are_joined(tmp_path, name):
    assert safe_join(tmp_path, name) == tmp_path / name


@pytest.mark.parametrize(
    "name,why",
    [
        ("", "is empty"),
        ("/etc/passwd", "is an absolute path"),
        ("../x", "'..' segment"),
        ("a/../../x", "'..' segment"),
        ("a/./b", "'.' or '..' segment"),
        ("a//b", "empty, '.' or '..' segment"),
        ("a/", "empty, '.' or '..' segment"),
        ("a\\..\\b", "backslash"),
        ("a\0b", "NUL"),
        ("prefix/../../../.local/lib/python3.11/site-packages/usercustomize.py", "'..' segment"),
    ],
)
def test_names_that_leave_the_root_are_refused_and_named(tmp_path, name, why):
    with pytest.raises(UnsafeName) as caught:
        safe_join(tmp_path, name)
    assert why in str(caught.value) and repr(name) in str(caught.value)


def test_flat_refuses_a_folder(tmp_path):
    assert safe_join(tmp_path, "shard.bin", flat=True) == tmp_path / "shard.bin"
    with pytest.raises(UnsafeName, match="not a plain file name"):
        safe_join(tmp_path, "sub/shard.bin", flat=True)


def test_a_link_inside_the_root_that_points_out_is_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside, root / "link")
    with pytest.raises(UnsafeName, match="leads out of"):
        safe_join(root, "link/file")
    (root / "inner").mkdir()
    os.symlink(root / "inner", root / "ok")
    assert safe_join(root, "ok/file") == root / "ok" / "file"
