"""The on-disk generation format: commit marker, validation, latest pointer, retention (no torch needed)."""

import json

import pytest

from rundir.checkpoints import (
    Best,
    CheckpointInvalid,
    commit,
    generations,
    latest_committed,
    newest_valid,
    prune,
    read_latest,
    remove_stale_tmp,
    sha256_file,
    step_name,
    validate,
)


def make_generation(root, step, payload=b"weights", evaluated: dict | None = None):
    tmp = root / f".tmp-{step_name(step)}"
    tmp.mkdir(parents=True)
    (tmp / "data.bin").write_bytes(payload * 100)
    files = {"data.bin": {"size": len(payload) * 100, "sha256": sha256_file(tmp / "data.bin")}}
    commit(tmp, root / step_name(step), {"step": step, "files": files, "eval": evaluated})
    return root / step_name(step)


def test_commit_makes_a_valid_generation_and_moves_latest(tmp_path):
    assert newest_valid(tmp_path, print) is None
    make_generation(tmp_path, 4)
    assert read_latest(tmp_path) == "step_00000004"
    path = make_generation(tmp_path, 8)
    assert read_latest(tmp_path) == "step_00000008"
    assert validate(path)["step"] == 8
    assert [s for s, _ in generations(tmp_path)] == [4, 8]
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "tamper", "missing_file", "bad_json"])
def test_damaged_generations_are_skipped_with_the_file_named(tmp_path, damage):
    make_generation(tmp_path, 4)
    newest = make_generation(tmp_path, 8)
    data, manifest = newest / "data.bin", newest / "manifest.json"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:10])
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[5] ^= 1
        data.write_bytes(bytes(raw))
    elif damage == "no_manifest":
        manifest.unlink()
    elif damage == "tamper":
        m = json.loads(manifest.read_text())
        m["step"] = 9
        manifest.write_text(json.dumps(m))
    elif damage == "missing_file":
        data.unlink()
    elif damage == "bad_json":
        manifest.write_text("{")
    warnings = []
    path, found = newest_valid(tmp_path, warnings.append)
    assert found["step"] == 4 and path.name == "step_00000004"
    assert len(warnings) == 1 and "step_00000008" in warnings[0]
    named = manifest if damage in ("no_manifest", "tamper", "bad_json") else data
    assert str(named) in warnings[0]
    assert newest.exists()  # nothing deleted


def test_no_valid_generation_is_an_error_not_a_fresh_start(tmp_path):
    gen = make_generation(tmp_path, 4)
    (gen / "data.bin").write_bytes(b"")
    with pytest.raises(CheckpointInvalid, match="none of the 1 checkpoints"):
        newest_valid(tmp_path, lambda w: None)
    assert gen.exists()


def test_the_search_takes_the_callers_generations_and_check(tmp_path):
    """The trainer's ranks search the list rank 0 made with a check they share: the loop follows that list, newest
    first, skips what the check refuses and lets any other error through (a transient read: retried by the caller)."""
    gens = [make_generation(tmp_path, step) for step in (4, 8, 12)]
    seen, warnings = [], []

    def check(path):
        seen.append(path.name)
        if path == gens[1]:
            raise CheckpointInvalid(f"{path / 'data.bin'} is not this rank's share")
        return {"step": int(path.name.removeprefix("step_"))}

    assert newest_valid(tmp_path, warnings.append, check=check, paths=gens[:2]) == (gens[0], {"step": 4})
    assert seen == ["step_00000008", "step_00000004"]  # 12 is not in the caller's list
    assert warnings == [f"skipping checkpoint step_00000008: {gens[1] / 'data.bin'} is not this rank's share"]

    def refuse(path):
        raise CheckpointInvalid(f"{path} refused")

    with pytest.raises(CheckpointInvalid, match=r"none of the 3 checkpoints .*12 refused; .*08 refused; .*04 refused"):
        newest_valid(tmp_path, lambda w: None, check=refuse)

    def unreadable(path):
        raise OSError(5, "Input/output error", str(path / "manifest.json"))

    with pytest.raises(OSError, match="Input/output error") as info:
        newest_valid(tmp_path, pytest.fail, check=unreadable)
    assert not isinstance(info.value, CheckpointInvalid)


def test_prune_keeps_last_k_and_every_m(tmp_path):
    for step in range(2, 26, 2):
        make_generation(tmp_path, step)
    (tmp_path / ".tmp-step_00000026").mkdir()
    removed = prune(tmp_path, keep_last=2, keep_every=8)
    assert [s for s, _ in generations(tmp_path)] == [8, 16, 22, 24]
    assert len(removed) == 8
    assert (tmp_path / ".tmp-step_00000026").exists()  # prune never touches uncommitted writes
    assert remove_stale_tmp(tmp_path) == [tmp_path / ".tmp-step_00000026"]
    assert latest_committed(tmp_path)["step"] == 24


@pytest.mark.parametrize("mode,kept", [("min", [6, 12, 22, 24]), ("max", [2, 14, 22, 24])])
def test_prune_keeps_the_best_k_by_an_eval_metric(tmp_path, mode, kept):
    """checkpoint.keep_best 3: the best three of the generations evaluated at their own step (eval_loss below: 24,
    6 and 12 lowest; 22, 2 and 14 highest), the newest among them; a generation whose evaluation was at an earlier
    step does not count (step 4 carries step 2's); the newest keep_last stay whatever they scored."""
    losses = {2: 3.0, 6: 1.0, 8: 2.5, 12: 1.5, 14: 2.9, 16: 2.0, 20: 2.2, 22: 5.0, 24: 0.5}
    for step in range(2, 26, 2):
        at = step if step in losses else step - 2
        make_generation(tmp_path, step, evaluated={"step": at, "eval_loss": losses.get(at, 9.0), "eval_acc": 0.1})
    prune(tmp_path, keep_last=2, keep_every=0, best=Best(3, "eval_loss", mode))
    assert [s for s, _ in generations(tmp_path)] == kept


def test_commit_sets_aside_an_invalid_generation_of_the_same_step(tmp_path):
    old = make_generation(tmp_path, 4)
    (old / "manifest.json").unlink()  # skipped on resume, then step 4 is reached again
    make_generation(tmp_path, 4, payload=b"new")
    assert validate(tmp_path / "step_00000004")["step"] == 4
    assert len(list(tmp_path.glob("step_00000004.invalid-*"))) == 1


@pytest.mark.parametrize("damage", ["tamper", "flip"])
def test_a_damaged_newer_generation_does_not_push_a_good_one_out(tmp_path, damage):
    """Resume fell back from a damaged 24 to 20 and then committed 22: 20 and 22 are the two to keep."""
    make_generation(tmp_path, 20)
    bad = make_generation(tmp_path, 24)
    if damage == "tamper":
        m = json.loads((bad / "manifest.json").read_text())
        m["step"] = 25
        (bad / "manifest.json").write_text(json.dumps(m))
    else:  # same size, other bytes: only the file hash shows it
        raw = bytearray((bad / "data.bin").read_bytes())
        raw[0] ^= 1
        (bad / "data.bin").write_bytes(bytes(raw))
    make_generation(tmp_path, 22)
    verified = {"step_00000022"}  # committed by this process
    assert prune(tmp_path, keep_last=2, keep_every=0, verified=verified) == []
    assert [s for s, _ in generations(tmp_path)] == [20, 22, 24]  # the damaged one is left for inspection
    assert verified == {"step_00000020", "step_00000022"}  # 20 was hashed once, and is remembered
    make_generation(tmp_path, 23)
    verified.add("step_00000023")
    removed = prune(tmp_path, keep_last=2, keep_every=0, verified=verified)
    assert removed == [tmp_path / "step_00000020"]
    assert [s for s, _ in generations(tmp_path)] == [22, 23, 24]
    assert verified == {"step_00000022", "step_00000023"}


def test_a_set_aside_generation_gets_a_name_of_its_own_and_goes_once_older_than_every_kept_one(tmp_path):
    """An invalid generation replaced by a new commit of its step is set aside under a unique name (a PID of an
    earlier process reused makes no clash), and pruning removes it once every kept generation is newer."""
    for _ in range(2):  # step 4 committed again over its copies, in one process (the same PID each time)
        path = make_generation(tmp_path, 4)
        (path / "manifest.json").unlink()
        make_generation(tmp_path, 4)
    aside = sorted(tmp_path.glob("step_00000004.invalid-*"))
    assert len(aside) == 3 and validate(tmp_path / "step_00000004")["step"] == 4
    make_generation(tmp_path, 8)
    assert prune(tmp_path, keep_last=2, keep_every=0) == []  # step 4 still kept: its set-aside copies stay
    make_generation(tmp_path, 12)
    removed = prune(tmp_path, keep_last=2, keep_every=0)
    assert removed == sorted([tmp_path / "step_00000004", *aside]) and not list(tmp_path.glob("*.invalid-*"))
