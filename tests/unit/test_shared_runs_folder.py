"""A runs folder shared with other users (a team's /scratch folder): what the package writes beside its run
directories (the Prometheus target file, the embedded MLflow store) never goes through a link or into a file that
another user put there, and another user's store does not stop this user's runs. The other user is a real second
Unix user (tests/conftest.py's other_user)."""

from __future__ import annotations

import getpass
import logging

from runconfig import load_config
from rundir import RunDir
from tests.conftest import as_user
from tracking import resolve, store_problem
from trainer.observe.live import _announce


def test_a_planted_target_link_is_refused_and_nothing_of_the_victims_is_touched(other_user, shared_scratch, caplog):
    secret = shared_scratch / "victim-secret.txt"
    secret.write_text("mine alone\n")
    secret.chmod(0o600)
    targets = shared_scratch / "prometheus"  # the other user's, with a link named as this user's run's target
    assert as_user(other_user, ["mkdir", "-m", "777", str(targets)]).returncode == 0
    assert as_user(other_user, ["ln", "-s", str(secret), str(targets / "run.json")]).returncode == 0
    run = RunDir(shared_scratch / "run")
    run.create()
    with caplog.at_level(logging.WARNING):
        assert _announce(run, ["node0:9100"]) is None
    assert f"{targets} belongs to {other_user.pw_name}" in caplog.text, caplog.text
    assert secret.read_text() == "mine alone\n" and (secret.stat().st_mode & 0o777) == 0o600


def test_another_users_embedded_store_does_not_stop_this_users_runs(other_user, shared_scratch):
    """The first user's store beside the runs (0600, theirs) once made every other user's tracked launch fail: in a
    runs folder that is not the user's own, the default store is one of the user's own there."""
    assert as_user(other_user, ["sh", "-c", f"umask 077; echo x > {shared_scratch}/mlflow.db"]).returncode == 0
    run = RunDir(shared_scratch / "run")
    run.create()
    target = resolve(load_config("tiny", ["tracking.backend=mlflow"]).tracking, run, {})
    assert target.store_path == shared_scratch / f".mlflow-{getpass.getuser()}" / "mlflow.db"
    assert store_problem(target) is None
    assert (target.store_path.parent.stat().st_mode & 0o777) == 0o700
    # a store the user names that is a link, or another user's, is refused with its name
    named = resolve(load_config("tiny", [f"tracking.uri={shared_scratch}/mlflow.db"]).tracking, run, {})
    assert "another user's file" in store_problem(named)
