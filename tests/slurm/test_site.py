"""A job started the way most sites start one, beside the MPICH wheel's path: Debian's Lmod and Open MPI with PMIx,
the project's environment in a venv whose mpi4py is built against that Open MPI, behind modulefiles
(envs/site/build.sh); `module load` on the login node and in the job; the ranks under `srun --mpi=pmix`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rundir.contract import EVENT_STOPPED
from tests.conftest import ROOT, history, summary
from tests.slurm.conftest import TWO_NODES, job_log, sets_for, wait_state, wait_step
from tests.slurm.test_slurm import resumed_bitwise

pytestmark = pytest.mark.slurm

PREFIX = Path(os.environ.get("HPC_SITE_PREFIX", "/opt/hpc-site"))
MODULES = ["module use " + str(PREFIX / "modulefiles"), "module load hpc-trainer"]


@pytest.fixture(scope="module")
def site():
    """The site environment: tests/run.sh starts its build beside the suite, and this build waits for that one
    (build.sh's lock), then finds the work done; alone, it builds (idempotent)."""
    for verb in ("install", "build"):
        subprocess.run(["bash", "envs/site/build.sh", verb, str(PREFIX)], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    return PREFIX


def in_a_login_shell(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """``script`` in bash after Lmod's init and the module loads, as a user types it on a login node: nothing of
    this test's venv on PATH or the import path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # this test's venv, and one activated in the shell that started the tests (its mpirun, MPICH's, would be found
    # before the system's Open MPI and pick srun's pmi2 plugin)
    venvs = {
        Path(sys.executable).parent,
        *([Path(os.environ["VIRTUAL_ENV"]) / "bin"] if "VIRTUAL_ENV" in os.environ else []),
    }
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p) not in venvs)
    lines = ["set -eo pipefail", "source /usr/share/lmod/lmod/init/bash", *MODULES, script]
    return subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120)  # fmt: skip


def started_with_open_mpi(run_dir: Path) -> None:
    records = sorted((run_dir / "record").glob("launch-*.json"))
    assert records, list(run_dir.iterdir())
    for path in records:
        assert json.loads(path.read_text())["software"]["mpi"].startswith("Open MPI v4.1"), path
    rank0 = (run_dir / "logs" / "rank_00000.log").read_text()
    assert "MPI library: Open MPI v4.1" in rank0
    assert "MPI library defaults applied" not in rank0  # MPICH's settings are not claimed for Open MPI


def test_module_load_open_mpi_and_pmix_train_stop_on_the_signal_and_requeue(
    site, slurm, small_dataset, reference_2x1, tmp_path
):
    run_dir = tmp_path / "run"
    sets = [*sets_for(small_dataset), *TWO_NODES, f"job.setup={json.dumps(['module purge', *MODULES])}"]
    submit = " ".join(["python -m hpc.submit tiny --run-dir", str(run_dir), *(f"--set '{s}'" for s in sets)])
    proc = in_a_login_shell(f"command -v python\n{submit}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0] == str(site / "venv" / "bin" / "python")
    job_id = json.loads((run_dir / "jobs.jsonl").read_text().splitlines()[-1])["job_id"]
    script = (run_dir / f"job_{job_id}.sbatch").read_text()
    assert "module purge\n" + "\n".join(MODULES) in script
    wait_step(run_dir, 10)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)  # to the job's steps: every rank
    resumed_bitwise(run_dir, job_id, reference_2x1)
    assert len([e for e in history(run_dir) if e["event"] == EVENT_STOPPED]) == 1
    driver = job_log(run_dir, job_id, lines=400)
    assert f"srun --mpi=pmix --kill-on-bad-exit=1 --overlap --ntasks-per-node=1 {site}/venv/bin/python" in driver
    started_with_open_mpi(run_dir)


def test_the_plain_sbatch_scripts_load_the_modules_of_envs_modules_sh(site, on_hosts, small_dataset, tmp_path):
    """HPC_SETUP=envs/modules.sh, PYTHON unset: the python the module puts first on PATH runs the ranks, 2 x 2 on
    separate hosts. (On the one-host cluster, Open MPI's shared-memory segments of two fake nodes' ranks collide:
    /dev/shm/vader_segment.<host>.<job>.<local rank> names the same file on both, and MPI_Init's allgather
    segfaults; envs/slurm/README.md.)"""
    run_dir = tmp_path / "run"
    sets = [*sets_for(small_dataset), "train.steps=20", "train.eval_every=10"]
    env = {
        "CONFIG": "tiny", "RUN_DIR": str(run_dir), "HPC_SET": " ".join(sets),
        "HPC_SETUP": str(ROOT / "envs" / "modules.sh"), "SLURM_CONF": os.environ["SLURM_CONF"],
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
    }  # fmt: skip
    proc = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", str(ROOT / "sbatch" / "train.sbatch")],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", output
    assert f"{site}/venv/bin/python" in output and "--mpi=pmix" in output, output
    assert summary(run_dir)["final_step"] == 20 and summary(run_dir)["world_size"] == 4
    started_with_open_mpi(run_dir)
