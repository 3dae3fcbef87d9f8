"""The recipe's code snapshot (rundir/snapshot.py): found without importing, copied into RUN_DIR/code at submit
time, verified and put first on the import path by every launch. Real files in tmp_path; no training is run."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from runconfig import ConfigError
from rundir import RunDir
from rundir import snapshot as codesnap
from rundir.contract import EVENT_CODE, EXIT_USER_ERROR
from rundir.paths import read_jsonl
from tests.conftest import as_user

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "mypkg.train:recipe"


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    """A user's project folder: proj/mypkg (a package with a train module), a config next to it, and litter."""
    root = tmp_path / "proj"
    pkg = root / "mypkg"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("def recipe(ctx, hidden=8):\n    return hidden\n")
    (pkg / "util").mkdir()
    (pkg / "util" / "helpers.py").write_text("X = 1\n")
    (pkg / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0compiled")
    (pkg / "stale.pyc").write_bytes(b"\0compiled")
    (pkg / ".hidden").write_text("secret")
    (pkg / ".git").mkdir()
    (pkg / ".git" / "HEAD").write_text("ref")
    (root / "config.yaml").write_text(f"recipe: {RECIPE}\n")
    return root


def names(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_search_path_is_config_folder_parent_then_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "a" / "b" / "config.yaml"
    assert codesnap.search_path(cfg) == [tmp_path / "a" / "b", tmp_path / "a", tmp_path]
    assert codesnap.search_path(tmp_path / "a" / "config.yaml") == [tmp_path / "a", tmp_path]  # deduplicated
    assert codesnap.search_path(None) == [tmp_path]


def test_locate_package_and_single_module(proj, tmp_path):
    search = codesnap.search_path(proj / "config.yaml")
    assert codesnap.locate(RECIPE, search) == proj / "mypkg"
    assert codesnap.locate("mypkg:recipe", search) == proj / "mypkg"
    assert codesnap.locate("mypkg.util.helpers:X", search) == proj / "mypkg"
    single = tmp_path / "other"
    single.mkdir()
    (single / "solo.py").write_text("def recipe(ctx): ...\n")
    assert codesnap.locate("solo:recipe", [single]) == single / "solo.py"
    # a namespace package (a plain folder) counts too
    (single / "ns" / "inner").mkdir(parents=True)
    (single / "ns" / "inner" / "mod.py").write_text("")
    assert codesnap.locate("ns.inner.mod:f", [single]) == single / "ns"


def test_locate_none_for_builtin_and_installed(proj):
    search = [proj]
    assert codesnap.locate("gpt", search) is None
    assert codesnap.locate("json.decoder:JSONDecoder", search) is None  # installed, not in search
    assert codesnap.locate(RECIPE, search) == proj / "mypkg"
    assert "mypkg" not in sys.modules  # found, never imported


def test_locate_missing_submodule_or_module_is_a_config_error(proj, tmp_path):
    with pytest.raises(ConfigError) as info:
        codesnap.locate("mypkg.nothere:recipe", [proj])
    message = str(info.value)
    assert "mypkg.nothere:recipe" in message and str(proj / "mypkg") in message and "\n" not in message
    with pytest.raises(ConfigError) as info:
        codesnap.locate("nosuchpkg_zz.train:recipe", [proj, tmp_path])
    assert "nosuchpkg_zz.train:recipe" in str(info.value) and str(proj) in str(info.value)
    (tmp_path / "flat.py").write_text("")
    with pytest.raises(ConfigError, match="not a package"):
        codesnap.locate("flat.sub:f", [tmp_path])


def test_take_copies_code_only_with_manifest(proj, tmp_path):
    rundir = RunDir(tmp_path / "run")
    rundir.create()
    snap = codesnap.take(rundir, RECIPE, [proj])
    assert snap is not None and snap.module == "mypkg" and snap.files == 3
    assert snap.source == str(proj / "mypkg")
    assert names(rundir.code) == ["manifest.json", "mypkg/__init__.py", "mypkg/train.py", "mypkg/util/helpers.py"]
    manifest = json.loads((rundir.code / codesnap.CODE_MANIFEST).read_text())
    assert {k: manifest[k] for k in ("module", "sha256", "source", "files")} == {
        "module": "mypkg",
        "sha256": snap.sha256,
        "source": str(proj / "mypkg"),
        "files": 3,
    }
    assert isinstance(manifest["taken_at"], float)
    assert codesnap.read(rundir) == snap
    assert stat.S_IMODE(rundir.code.stat().st_mode) == 0o700
    assert not [p for p in rundir.root.iterdir() if p.name.startswith(".code")]  # no temporary folder left


def test_take_single_module_and_nothing_for_builtin(tmp_path):
    (tmp_path / "solo.py").write_text("def recipe(ctx): ...\n")
    rundir = RunDir(tmp_path / "run")
    rundir.create()
    assert codesnap.take(rundir, "gpt", [tmp_path]) is None
    assert codesnap.take(rundir, "json.decoder:JSONDecoder", [tmp_path]) is None
    assert not rundir.code.exists()
    snap = codesnap.take(rundir, "solo:recipe", [tmp_path])
    assert snap.module == "solo" and snap.files == 1
    assert names(rundir.code) == ["manifest.json", "solo.py"]
    old = sys.path[:]
    try:
        assert codesnap.activate(rundir) == snap.sha256
    finally:
        sys.path[:] = old


def test_a_single_module_takes_the_modules_beside_it_which_the_launch_imports_from_the_snapshot(tmp_path):
    """The ranks' import path does not hold the submit folder (PYTHONSAFEPATH), so a single-file recipe's helper
    modules come with it: the .py files of its folder, not its subfolders, verified like the recipe."""
    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    (src / "solo.py").write_text("import solohelp\n\ndef recipe(ctx):\n    return solohelp.X\n")
    (src / "solohelp.py").write_text("X = 'from the snapshot'\n")
    (src / "data" / "big.py").write_text("")
    (src / "notes.txt").write_text("")
    (tmp_path / "elsewhere.py").write_text("")
    (src / "linked.py").symlink_to(tmp_path / "elsewhere.py")
    rundir = RunDir(tmp_path / "run")
    rundir.create()
    with pytest.raises(ConfigError, match="linked.py links to .*outside the recipe's folder"):
        codesnap.take(rundir, "solo:recipe", [src])
    (src / "linked.py").unlink()
    snap = codesnap.take(rundir, "solo:recipe", [src])
    assert snap.files == 2 and names(rundir.code) == ["manifest.json", "solo.py", "solohelp.py"]
    (src / "solohelp.py").write_text("X = 'edited original'\n")
    old_path, old_modules = sys.path[:], set(sys.modules)
    try:
        assert codesnap.activate(rundir) == snap.sha256
        import solo

        assert solo.recipe(None) == "from the snapshot"
    finally:
        sys.path[:] = old_path
        for name in set(sys.modules) - old_modules:
            del sys.modules[name]
    (rundir.code / "solohelp.py").write_text("X = 'changed in the run directory'\n")
    with pytest.raises(ConfigError, match="was changed after submit"):
        codesnap.activate(rundir)


def test_hash_stable_and_content_sensitive(proj, tmp_path):
    a, b, c = (RunDir(tmp_path / name) for name in ("a", "b", "c"))
    first = codesnap.take(a, RECIPE, [proj])
    (proj / "mypkg" / "__pycache__" / "more.pyc").write_bytes(b"ignored")  # skipped files do not count
    second = codesnap.take(b, RECIPE, [proj])
    assert first.sha256 == second.sha256
    (proj / "mypkg" / "train.py").write_text("def recipe(ctx, hidden=16):\n    return hidden\n")
    third = codesnap.take(c, RECIPE, [proj])
    assert third.sha256 != first.sha256


def test_editing_the_original_after_take_changes_nothing(proj, tmp_path):
    rundir = RunDir(tmp_path / "run")
    snap = codesnap.take(rundir, RECIPE, [proj])
    (proj / "mypkg" / "train.py").write_text("def recipe(ctx):\n    raise SystemExit('edited')\n")
    (proj / "mypkg" / "new.py").write_text("")
    assert "hidden=8" in (rundir.code / "mypkg" / "train.py").read_text()
    assert not (rundir.code / "mypkg" / "new.py").exists()
    old = sys.path[:]
    try:
        assert codesnap.activate(rundir) == snap.sha256
    finally:
        sys.path[:] = old


def test_activate_puts_snapshot_first_once_and_imports_from_it(proj, tmp_path):
    rundir = RunDir(tmp_path / "run")
    snap = codesnap.take(rundir, RECIPE, [proj])
    (proj / "mypkg" / "train.py").write_text("def recipe(ctx):\n    return 'edited original'\n")
    old_path, old_modules = sys.path[:], set(sys.modules)
    try:
        assert codesnap.activate(rundir) == snap.sha256
        assert codesnap.activate(rundir) == snap.sha256
        entry = str(rundir.code.absolute())
        assert sys.path[0] == entry and sys.path.count(entry) == 1
        import mypkg.train  # the snapshot's copy: torch-free by construction of this test

        assert mypkg.train.recipe(None) == 8
        assert Path(mypkg.train.__file__).resolve() == (rundir.code / "mypkg" / "train.py").resolve()
    finally:
        sys.path[:] = old_path
        for name in set(sys.modules) - old_modules:
            del sys.modules[name]
    # Python's __pycache__ written into the snapshot by that import does not count as a change
    old = sys.path[:]
    try:
        assert codesnap.activate(rundir) == snap.sha256
    finally:
        sys.path[:] = old


def test_activate_without_snapshot_is_none(tmp_path):
    rundir = RunDir(tmp_path / "run")
    rundir.create()
    old = sys.path[:]
    assert codesnap.activate(rundir) is None
    assert sys.path == old


@pytest.mark.parametrize("tamper", ["edit", "add", "remove"])
def test_tampered_snapshot_is_a_config_error(proj, tmp_path, tamper):
    rundir = RunDir(tmp_path / "run")
    snap = codesnap.take(rundir, RECIPE, [proj])
    target = rundir.code / "mypkg" / "train.py"
    if tamper == "edit":
        target.write_text(target.read_text() + "# changed\n")
    elif tamper == "add":
        (rundir.code / "mypkg" / "extra.py").write_text("")
    else:
        target.unlink()
    old = sys.path[:]
    try:
        with pytest.raises(ConfigError) as info:
            codesnap.activate(rundir)
    finally:
        assert sys.path == old  # nothing put on the path for a changed snapshot
        sys.path[:] = old
    message = str(info.value)
    assert "was changed after submit" in message and str(rundir.code) in message and snap.sha256 in message


def test_refresh_replaces_the_snapshot(proj, tmp_path):
    rundir = RunDir(tmp_path / "run")
    first = codesnap.take(rundir, RECIPE, [proj])
    (proj / "mypkg" / "train.py").write_text("def recipe(ctx):\n    return 'v2'\n")
    (proj / "mypkg" / "util" / "helpers.py").unlink()
    second = codesnap.refresh(rundir, RECIPE, [Path(first.source).parent])
    assert second.sha256 != first.sha256 and second.files == 2
    assert codesnap.read(rundir) == second
    assert "v2" in (rundir.code / "mypkg" / "train.py").read_text()
    assert not (rundir.code / "mypkg" / "util").exists()
    assert not [p for p in rundir.root.iterdir() if p.name.startswith(".code")]
    with pytest.raises(ConfigError, match="elsewhere"):  # moved away: an error, the snapshot kept
        codesnap.refresh(rundir, RECIPE, [tmp_path / "elsewhere"])
    assert codesnap.read(rundir) == second  # left as it was


def test_oversized_file_is_refused_and_nothing_written(proj, tmp_path):
    big = proj / "mypkg" / "weights.bin"
    with open(big, "wb") as f:
        f.truncate(codesnap.MAX_FILE_BYTES + 1)  # sparse: no 20 MB written
    rundir = RunDir(tmp_path / "run")
    rundir.create()
    with pytest.raises(ConfigError) as info:
        codesnap.take(rundir, RECIPE, [proj])
    assert str(big) in str(info.value) and RECIPE in str(info.value)
    assert not rundir.code.exists()
    assert not [p for p in rundir.root.iterdir() if p.name.startswith(".code")]


def test_oversized_total_is_refused(proj, tmp_path, monkeypatch):
    monkeypatch.setattr(codesnap, "MAX_TOTAL_BYTES", 40)
    (proj / "mypkg" / "data.txt").write_text("x" * 41)
    with pytest.raises(ConfigError, match="add up to more than"):
        codesnap.take(RunDir(tmp_path / "run"), RECIPE, [proj])


def test_run_directory_inside_the_package_is_not_copied(proj):
    rundir = RunDir(proj / "mypkg" / "runs" / "r1")
    rundir.create()
    (rundir.root / "metrics.jsonl").write_text("{}\n")
    snap = codesnap.take(rundir, RECIPE, [proj])
    assert snap.files == 3
    assert not (rundir.code / "mypkg" / "runs").exists()


def test_submit_helpers_record_the_code_event(proj, tmp_path, capsys):
    from hpc.submit import refresh_code, snapshot_new_run

    rundir = RunDir(tmp_path / "run")
    rundir.create()
    snap = snapshot_new_run(rundir, RECIPE, codesnap.search_path(proj / "config.yaml"))
    assert capsys.readouterr().out.strip() == f"code snapshot: mypkg {snap.sha256[:12]} (3 files)"
    (proj / "mypkg" / "train.py").write_text("def recipe(ctx):\n    return 'v2'\n")
    again = refresh_code(rundir, RECIPE)
    assert again.sha256 != snap.sha256
    events = [e for e in read_jsonl(rundir.history) if e["event"] == EVENT_CODE]
    assert [(e["sha256"], e["refreshed"]) for e in events] == [(snap.sha256, False), (again.sha256, True)]
    assert events[0]["module"] == "mypkg" and events[0]["source"] == str(proj / "mypkg")


def run_submit(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "hpc.submit", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def test_dry_run_with_a_missing_recipe_module_exits_2(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("recipe: nosuchpkg_zz.train:recipe\n")
    proc = run_submit([str(config), "--local", "--dry-run", "--run-dir", str(tmp_path / "run")], tmp_path)
    assert proc.returncode == EXIT_USER_ERROR, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nosuchpkg_zz.train:recipe" in lines[0]
    assert not (tmp_path / "run").exists()


def test_dry_run_locates_and_creates_nothing(proj, tmp_path):
    proc = run_submit([str(proj / "config.yaml"), "--local", "--dry-run", "--run-dir", str(tmp_path / "run")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "run").exists()


def test_refresh_code_needs_a_resume(proj, tmp_path):
    proc = run_submit([str(proj / "config.yaml"), "--local", "--refresh-code"], tmp_path)
    assert proc.returncode == EXIT_USER_ERROR and "--refresh-code" in proc.stderr


def test_resume_with_a_recipe_outside_the_snapshot_asks_for_refresh(proj, tmp_path):
    rundir = RunDir(tmp_path / "run")
    rundir.create()
    codesnap.take(rundir, RECIPE, [proj])
    rundir.config.write_text(f"recipe: {RECIPE}\n")
    (proj / "otherpkg").mkdir()
    (proj / "otherpkg" / "__init__.py").write_text("def recipe(ctx): ...\n")
    proc = run_submit(["--resume", str(rundir.root), "--local", "--dry-run", "--set", "recipe=otherpkg:recipe"], proj)
    assert proc.returncode == EXIT_USER_ERROR and "--refresh-code" in proc.stderr, proc.stderr
    proc = run_submit(["--resume", str(rundir.root), "--local", "--dry-run"], proj)
    assert proc.returncode == 0, proc.stderr


def test_a_link_out_of_the_package_is_refused_and_one_inside_is_followed(proj, tmp_path):
    """The snapshot is the recipe's own code: a link to a folder outside the package (a home directory, a shared
    tree) would copy what it points at, so it is refused by name; a link between the package's own folders is kept."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "id_rsa").write_text("not code")
    (proj / "mypkg" / "alias.py").symlink_to(proj / "mypkg" / "util" / "helpers.py")
    snap = codesnap.take(RunDir(tmp_path / "run1"), RECIPE, [proj])
    assert snap is not None and (tmp_path / "run1" / "code" / "mypkg" / "alias.py").read_text() == "X = 1\n"
    (proj / "mypkg" / "outside").symlink_to(tmp_path / "elsewhere")
    rundir = RunDir(tmp_path / "run2")
    with pytest.raises(ConfigError, match=f"{proj}/mypkg/outside links to {tmp_path}/elsewhere, outside the recipe"):
        codesnap.take(rundir, RECIPE, [proj])
    assert not rundir.code.exists()


def test_too_many_files_are_refused(proj, tmp_path, monkeypatch):
    monkeypatch.setattr(codesnap, "MAX_FILES", 5)
    for i in range(6):
        (proj / "mypkg" / f"part{i}.txt").write_text("x")
    with pytest.raises(ConfigError, match="add up to more than 5 files"):
        codesnap.take(RunDir(tmp_path / "run"), RECIPE, [proj])


def test_a_package_another_user_put_beside_a_shared_config_is_refused(other_user, shared_scratch, monkeypatch):
    """A config kept in a shared folder: the recipe's package found beside it (or in its parent) must be the
    user's own (or root's), in a folder no one else may write; from the submit folder it is the user's choice."""
    (shared_scratch / "configs").mkdir()
    config = shared_scratch / "configs" / "run.yaml"
    config.write_text(f"recipe: {RECIPE}\n")
    planted = shared_scratch / "mypkg"
    assert as_user(other_user, ["mkdir", str(planted)]).returncode == 0
    for name in ("__init__.py", "train.py"):
        assert as_user(other_user, ["sh", "-c", f"echo 'def recipe(ctx): pass' > {planted / name}"]).returncode == 0
    monkeypatch.chdir("/")
    with pytest.raises(ConfigError, match=f"{planted} belongs to {other_user.pw_name}"):
        codesnap.locate(RECIPE, codesnap.search_path(config))
    monkeypatch.chdir(shared_scratch)  # submitted from the folder that holds it: the user chose it
    assert codesnap.locate(RECIPE, codesnap.search_path(config)) == planted
