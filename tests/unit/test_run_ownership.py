"""A run directory is its owner's: one that another user made, or that others may write, is refused before
anything is read from it or written into it, by `python -m hpc.submit` and by the plain sbatch scripts. The attacker
is a real second Unix user (tests/conftest.py's other_user)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from runconfig import dump_yaml, load_config
from tests.conftest import ROOT, as_user, run_cli


def listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def hpc_prepare(mode: str, run_dir: Path, **env: str) -> subprocess.CompletedProcess:
    """sbatch/common.sh's preparation of a job, as train.sbatch (``train``) or resume.sbatch runs it."""
    script = 'source sbatch/common.sh; hpc_prepare "$1" "$2"'
    full = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(["bash", "-c", script, "bash", mode, str(run_dir)], capture_output=True, text=True,
                          env=full, cwd=ROOT)  # fmt: skip


def test_a_run_directory_another_user_made_is_refused(other_user, shared_scratch):
    planted = shared_scratch / "team-run"
    assert as_user(other_user, ["mkdir", "-m", "755", str(planted)]).returncode == 0
    text = dump_yaml(load_config("tiny", ["train.steps=1"]))
    assert as_user(other_user, ["sh", "-c", f"cat > {planted}/config.yaml"], input=text).returncode == 0
    before = listing(planted)
    for args in (["--resume", str(planted), "--local"], [str(planted), "--local"]):
        proc = run_cli(["-m", "hpc.submit", *args])
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"run directory {planted} is not yours" in proc.stderr and other_user.pw_name in proc.stderr
    for mode, env in (("train", {"CONFIG": "tiny"}), ("resume", {})):
        proc = hpc_prepare(mode, planted, SLURM_JOB_ID="7", **env)
        assert proc.returncode == 2 and "is not yours" in proc.stderr, proc.stdout + proc.stderr
    assert listing(planted) == before  # nothing written into it, nothing made readable
    # An empty folder made by the other user for a new run (--run-dir), and one under theirs.
    empty = shared_scratch / "empty"
    assert as_user(other_user, ["mkdir", "-m", "777", str(empty)]).returncode == 0
    proc = run_cli(["-m", "hpc.submit", "tiny", "--local", "--run-dir", str(empty)])
    assert proc.returncode == 2 and "is not yours" in proc.stderr, proc.stdout + proc.stderr
    assert list(empty.iterdir()) == []
    proc = hpc_prepare("train", empty, CONFIG="tiny", SLURM_JOB_ID="7")
    assert proc.returncode == 2 and "is not yours" in proc.stderr, proc.stdout + proc.stderr
    assert list(empty.iterdir()) == []


def test_a_run_directory_others_may_write_or_a_linked_config_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "config.yaml").write_text(dump_yaml(load_config("tiny", ["train.steps=1"])))
    run_dir.chmod(0o777)  # a group- or world-writable run directory: anyone could replace its config
    proc = run_cli(["-m", "hpc.submit", "--resume", str(run_dir), "--local"])
    assert proc.returncode == 2 and "may be written by others (mode 777)" in proc.stderr, proc.stderr
    assert f"chmod 700 {run_dir}" in proc.stderr
    run_dir.chmod(0o700)
    (run_dir / "config.yaml").rename(tmp_path / "elsewhere.yaml")
    (run_dir / "config.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    proc = hpc_prepare("resume", run_dir, SLURM_JOB_ID="7")
    assert proc.returncode == 2 and "config.yaml is not a regular file" in proc.stderr, proc.stderr
