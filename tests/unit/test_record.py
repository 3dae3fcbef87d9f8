"""The record of a submission (rundir/record.py): the variables that change behaviour without credentials, and
the recipe's project repository with its commit and uncommitted diff, read from a real git checkout."""

from __future__ import annotations

import json
import subprocess

from rundir.record import project_repository, recorded_environment, write_submission


def test_behaviour_variables_are_kept_and_credentials_left_out():
    environ = {
        "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "SLURM_JOB_ID": "12", "FI_PROVIDER": "efa", "HOME": "/root",
        "PATH": "/bin", "HPC_WANDB_API_KEY": "x", "NCCL_IB_KEY": "x", "HPC_X_TOKEN_FILE": "/t", "HPC_PASSWORD": "p",
        "AWS_SECRET_ACCESS_KEY": "s", "AWS_ACCESS_KEY_ID": "AKIAABCDEFGHIJKLMNOP", "HPC_NOTE": "AKIAABCDEFGHIJKLMNOP",
        "SLURM_JOB_NAME": "https://user:pw@host/x",
    }  # fmt: skip
    assert recorded_environment(environ) == {
        "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "SLURM_JOB_ID": "12", "FI_PROVIDER": "efa",
    }  # fmt: skip


def git(folder, *args):
    subprocess.run(["git", "-C", str(folder), "-c", "user.email=t@example.org", "-c", "user.name=t", *args],
                   check=True, capture_output=True)  # fmt: skip


def test_the_project_repository_is_recorded_with_its_uncommitted_diff(tmp_path):
    project = tmp_path / "proj"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "model.py").write_text("WIDTH = 1\n")
    (project / "other").mkdir()
    (project / "other" / "settings.py").write_text("TOKEN = None\n")
    git(project, "init", "-q", "-b", "main")
    git(project, "add", ".")
    git(project, "commit", "-q", "-m", "first")
    head = subprocess.run(["git", "-C", str(project), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    facts, diff = project_repository(project / "pkg")
    assert facts["commit"] == head.strip() and facts["branch"] == "main" and not facts["dirty"] and diff == ""

    (project / "pkg" / "model.py").write_text("WIDTH = 2\n")
    (project / "pkg" / "notes.txt").write_text("new\n")
    (project / "other" / "settings.py").write_text("TOKEN = 'another project's work, not this run's'\n")
    (project / "scratch.txt").write_text("new\n")
    path = write_submission(tmp_path / "record", "python -m hpc.submit cfg.yaml", resumed=False,
                            project_source=str(project / "pkg"))  # fmt: skip
    record = json.loads(path.read_text())
    assert path.name == "submit-000.json" and record["command"] == "python -m hpc.submit cfg.yaml"
    # the project's own folder only: the rest of the checkout is none of the run's record
    assert record["project"]["dirty"] and record["project"]["untracked"] == ["pkg/notes.txt"]
    assert record["project"]["project"] == "pkg"
    recorded = (tmp_path / "record" / "submit-000.diff").read_text()
    assert "+WIDTH = 2" in recorded and "TOKEN" not in recorded and "settings.py" not in recorded
    again = write_submission(tmp_path / "record", "x", resumed=True, project_source=None)
    assert again.name == "submit-001.json" and json.loads(again.read_text())["project"] is None
    assert project_repository(tmp_path / "record") == (None, "")  # no checkout there
