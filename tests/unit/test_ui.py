"""`python -m hpc ui`: which store it opens and what it refuses, named (the UI itself in a real browser:
tests/mp/test_tracking.py)."""

from __future__ import annotations

import json
import os
import socket

from hpc.ui import tracking_uri
from rundir.contract import EXIT_USER_ERROR
from tests.conftest import run_cli


def ui(*args: str):
    return run_cli(["-m", "hpc", "ui", *args], timeout=60)


def test_the_store_of_a_runs_folder_a_run_directory_or_a_file(tmp_path):
    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    (runs / "mlflow.db").write_bytes(b"")
    assert tracking_uri(runs) == f"sqlite:///{runs / 'mlflow.db'}"
    assert tracking_uri(runs / "mlflow.db") == f"sqlite:///{runs / 'mlflow.db'}"
    (runs / "a" / "config.yaml").write_text("{}\n")
    (runs / "a" / "tracking.json").write_text(json.dumps({"backend": "mlflow", "uri": "http://mlflow.example:5000"}))
    assert tracking_uri(runs / "a") == "http://mlflow.example:5000"
    served = ui(str(runs / "a"))  # a server's runs: its own UI, nothing started
    assert served.returncode == 0 and "tracked by the MLflow server http://mlflow.example:5000" in served.stdout


def test_refusals_name_the_folder_the_file_or_the_port(tmp_path):
    empty = ui(str(tmp_path))
    assert empty.returncode == EXIT_USER_ERROR and f"{tmp_path} holds no MLflow store" in empty.stderr
    untracked = tmp_path / "run"
    untracked.mkdir()
    (untracked / "config.yaml").write_text("{}\n")
    proc = ui(str(untracked))
    assert proc.returncode == EXIT_USER_ERROR and "was not tracked in MLflow" in proc.stderr
    # a store that is a link (to someone else's, say) is never opened: the server would migrate and write it
    runs = tmp_path / "runs"
    runs.mkdir()
    (tmp_path / "theirs.db").write_bytes(b"")
    os.symlink(tmp_path / "theirs.db", runs / "mlflow.db")
    proc = ui(str(runs))
    assert proc.returncode == EXIT_USER_ERROR and "is a link, missing, or another user's file" in proc.stderr
    (runs / "mlflow.db").unlink()
    (runs / "mlflow.db").write_bytes(b"")
    runs.chmod(0o777)  # others may write the store's folder: they could plant a journal SQLite would replay
    proc = ui(str(runs))
    assert proc.returncode == EXIT_USER_ERROR and "others may write it" in proc.stderr, proc.stderr
    runs.chmod(0o755)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = ui(str(runs), "--port", str(taken.getsockname()[1]))
    assert proc.returncode == EXIT_USER_ERROR and "(choose another --port)" in proc.stderr, proc.stderr
