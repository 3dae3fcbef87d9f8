"""rundir/identity.py: a run's id and key, made once with its run directory (0600, never a link followed); a
manifest sealed with them is the run's, one that names another run or that the key does not authenticate is not."""

from __future__ import annotations

import os

import pytest

from rundir import RunDir
from rundir.identity import ensure_identity, manifest_problem, read_identity, seal_manifest


def test_a_run_directory_gets_one_identity_private_to_it(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    first = read_identity(run.identity)
    assert len(first.run_id) == 32 and len(first.key) == 32
    assert (run.identity.stat().st_mode & 0o777) == 0o600
    run.create()  # again (a resume): the same identity
    assert ensure_identity(run.identity) == first
    other = RunDir(tmp_path / "other")
    other.create()
    assert read_identity(other.identity).run_id != first.run_id
    link = tmp_path / "link.json"
    link.symlink_to(run.identity)
    with pytest.raises(OSError):
        read_identity(link)
    os.unlink(link)


def test_a_sealed_manifest_is_the_runs_and_a_changed_or_foreign_one_is_not(tmp_path):
    mine = ensure_identity(tmp_path / "a.json")
    theirs = ensure_identity(tmp_path / "b.json")
    body = {"step": 8, "files": {"dcp/.metadata": {"size": 10, "sha256": "ab" * 32}}}
    sealed = seal_manifest(body, mine)
    assert sealed["run_id"] == mine.run_id and manifest_problem({**sealed, "manifest_sha256": "x"}, mine) is None
    changed = {**sealed, "files": {"dcp/.metadata": {"size": 11, "sha256": "cd" * 32}}}
    assert manifest_problem(changed, mine)[0] == "unsealed"
    assert manifest_problem(body, mine)[0] == "unsealed"  # written before runs had keys, or by hand
    assert manifest_problem(seal_manifest(body, theirs), mine) == (
        "other",
        f"its manifest names another run (run id {theirs.run_id[:12]})",
    )
    forged = {**sealed, "run_mac": seal_manifest(changed, theirs)["run_mac"]}
    assert manifest_problem(forged, mine)[0] == "unsealed"
