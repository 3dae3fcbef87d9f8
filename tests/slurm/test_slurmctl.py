"""The one door to Slurm's commands (hpc/slurmctl.py) against the real local cluster: job states in one batch,
array tasks and unknown ids among them, and a command that fails raising with Slurm's own answer."""

from __future__ import annotations

import subprocess

import pytest

from hpc import slurmctl


def _submit(*args: str) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", "-N1", "-t", "5", "-o", "/dev/null", *args, "--wrap", "sleep 60"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().split(";")[0]


def test_job_states_in_one_batch_with_array_tasks_and_an_unknown_job(slurm):
    held = _submit("--hold")
    array = _submit("--hold", "--array=0-1")
    try:
        ids = [held, f"{array}_1", "999999", f"{array}_0"]
        states = slurmctl.job_states(ids)
        assert list(states) == ids  # in the order asked
        assert states[held].state == "PENDING" and states[held].held and states[held].source == "squeue"
        assert states[f"{array}_0"].held and states[f"{array}_1"].held
        unknown = states["999999"]
        assert unknown.state == "UNKNOWN" and unknown.finished and "no longer knows it" in unknown.reason
        slurmctl.release(held)
        assert not slurmctl.job_state(held).held
    finally:
        slurmctl.cancel([held, array])
    assert all(slurmctl.job_state(j).state in ("CANCELLED", "COMPLETING") for j in (held, f"{array}_0"))


def test_a_command_that_fails_raises_naming_the_command_and_slurm_s_answer(slurm):
    with pytest.raises(slurmctl.SlurmError, match=r"scontrol hold 999999 failed: .*[Ii]nvalid job id"):
        slurmctl.hold("999999")
