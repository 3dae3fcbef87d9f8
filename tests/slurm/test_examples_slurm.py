"""A user project (examples/digits) on the REAL local Slurm cluster through `python -m hpc.submit`, preempted by the
job's signal mid-run and requeued: it ends bit-identical to the same config run locally."""

import json
import subprocess
from pathlib import Path

import pytest

from rundir.contract import EVENT_CODE, EVENT_STOPPED, INJECT_VAR
from tests.conftest import example_args, history, run_cli, summary
from tests.slurm.conftest import wait_step
from tests.slurm.test_slurm import resumed_bitwise

pytestmark = pytest.mark.slurm


def test_example_requeued_on_slurm_ends_bitwise(slurm, example_reference, tmp_path):
    reference = summary(example_reference("digits"))["params_sha256"]
    run_dir = tmp_path / "run"
    # Rank 0 sleeps 50 ms a step (timing only), so the signal lands mid-run.
    proc = run_cli(example_args("digits", run_dir, "--set", f"job.env.{INJECT_VAR}=slow:0:0.05"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "submitted digits as Slurm job" in proc.stdout and "code snapshot: digits" in proc.stdout
    job_id = json.loads((Path(run_dir) / "jobs.jsonl").read_text().splitlines()[-1])["job_id"]
    wait_step(run_dir, 8)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    resumed_bitwise(run_dir, job_id, reference)
    events = history(run_dir)
    assert any(e["event"] == EVENT_STOPPED for e in events)
    code = [e for e in events if e["event"] == EVENT_CODE]
    assert len(code) == 1 and summary(run_dir)["code_sha256"] == code[0]["sha256"]  # every launch ran the snapshot
