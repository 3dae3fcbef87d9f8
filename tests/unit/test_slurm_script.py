"""The generated sbatch script: golden file, validation and quoting of every config value that reaches it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpc.slurm import sbatch_script
from runconfig import ConfigError, load_config
from runconfig.schema import slurm_minutes
from rundir import RunDir
from tests.conftest import run_cli

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "tiny_slurm.sbatch"
UPDATE_GOLDEN_VAR = "HPC_UPDATE_GOLDEN"  # =1 rewrites the golden file (a test-only switch, not a run contract)
FULL = [
    "job.partition=debug", "job.account=proj1", "job.qos=high", "job.gpus_per_node=2", "job.mem=64G",
    "job.constraint=ib&a100", "job.exclusive=true", "job.time=1-02:00:00", "job.signal_lead_s=300",
    "job.setup=[module load cuda/12.4, source /opt/env.sh]", "job.env={NCCL_IB_HCA: mlx5_0, UCX_NET_DEVICES: mlx5_0:1}",
    "job.sbatch_extra={reservation: big, mail-type: END}", "job.srun_args=[--cpu-bind=cores]",
]  # fmt: skip


def dry_run(*sets: str) -> str:
    args = ["-m", "hpc.submit", "tiny", "--dry-run", "--slurm", "--run-dir", "/RUN"]
    for s in sets:
        args += ["--set", s]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.replace(sys.executable, "PYTHON")


def test_dry_run_matches_golden_file():
    """The script must equal the committed golden file. A missing or stale file fails: only
    ``HPC_UPDATE_GOLDEN=1`` (re)writes it, on purpose, for a review of its diff before it is committed."""
    text = dry_run(*FULL)
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    if os.environ.get(UPDATE_GOLDEN_VAR) == "1":
        GOLDEN.write_text(text)
    how = f"regenerate it on purpose with {UPDATE_GOLDEN_VAR}=1 and review the diff before committing it"
    assert GOLDEN.is_file(), f"golden file {GOLDEN} is missing: {how}"
    assert text == GOLDEN.read_text(), f"the sbatch script differs from {GOLDEN}: if the change is intended, {how}"


@pytest.mark.parametrize(
    "field,value,key",
    [
        ("name", "x\n#SBATCH --uid=0", "job.name"),
        ("name", "a$(id)", "job.name"),
        ("name", 'a"b', "job.name"),
        ("partition", "debug --qos=free", "job.partition"),
        ("partition", "debug\n#SBATCH --x", "job.partition"),
        ("account", "'a'", "job.account"),
        ("qos", "`id`", "job.qos"),
        ("constraint", "ib;rm", "job.constraint"),
        ("mem", "64G$(id)", "job.mem"),
        ("time", "1h", "job.time"),
        ("setup", ["ls\necho injected"], "job.setup[0]"),
        ("sbatch_extra", {"reservation": "x\ny"}, "job.sbatch_extra.reservation"),
        ("sbatch_extra", {"reservation": "$(id)"}, "job.sbatch_extra.reservation"),
        ("sbatch_extra", {"a b": "x"}, "job.sbatch_extra.a b"),
        ("srun_args", ["--x=$(id)"], "job.srun_args[0]"),
        ("srun_args", ["--a; rm -rf /"], "job.srun_args[0]"),
        ("env", {"A-B": "x"}, "job.env.A-B"),
        ("env", {"A": "x\ny"}, "job.env.A"),
        ("signal", "SIGUSR1", "job.signal"),
        # a trailing newline ends sbatch's directive parsing: every check matches the whole value
        ("name", "demo\n", "job.name"),
        ("partition", "debug\n", "job.partition"),
        ("account", "a\n", "job.account"),
        ("qos", "q\n", "job.qos"),
        ("constraint", "ib\n", "job.constraint"),
        ("mem", "64G\n", "job.mem"),
        ("time", "30\n", "job.time"),
        ("sbatch_extra", {"reservation": "x\n"}, "job.sbatch_extra.reservation"),
        ("sbatch_extra", {"reservation\n": "x"}, "job.sbatch_extra.reservation\n"),
        ("srun_args", ["--x=1\n"], "job.srun_args[0]"),
        ("launch_prefix", ["nsys\n"], "job.launch_prefix[0]"),
        ("env", {"A\n": "x"}, "job.env.A\n"),
        ("env", {"A": "x\n"}, "job.env.A"),
    ],
)
def test_unsafe_values_are_rejected_with_the_key(tmp_path, field, value, key):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"job": {field: value}}))
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert repr(key) in str(info.value) and str(path) in str(info.value), str(info.value)


def test_setup_lines_and_env_values_are_quoted_not_expanded():
    cfg = load_config(
        "tiny",
        ['job.setup=["export X=$(id) `id`", "echo \'a\' \\"b\\"; rm -rf /"]', 'job.env={A: "$(id); x\'y"}'],
    )
    text = sbatch_script(cfg, RunDir(Path("/RUN")))
    assert "export 'X=$(id)' '`id`'" in text
    assert "echo a b\\; rm -rf /" not in text and "'b;' rm -rf /" in text  # the ';' is inside quotes
    assert "export A=" in text and "'$(id); x'\"'\"'y'" in text
    # nothing outside quotes can run: bash's parser sees one simple command per line
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_only_expected_sbatch_lines():
    text = dry_run(*FULL)
    keys = sorted(line.split("=")[0].split()[1] for line in text.splitlines() if line.startswith("#SBATCH"))
    assert keys == sorted(
        ["--account", "--constraint", "--cpus-per-task", "--exclusive", "--gpus-per-node", "--job-name", "--mail-type",
         "--mem", "--nodes", "--ntasks-per-node", "--open-mode", "--output", "--partition", "--qos", "--requeue",
         "--reservation", "--signal", "--time", "--wckey"]
    )  # fmt: skip


@pytest.mark.parametrize(
    "text,minutes",
    [
        ("30", 30),
        ("25:00", 25),
        ("10:30", 11),
        ("01:00:00", 60),
        ("00:00:30", 1),
        ("1-00", 1440),
        ("2-03:04:00", 2 * 1440 + 184),
    ],  # fmt: skip
)
def test_time_limits(text, minutes):
    assert slurm_minutes(text) == minutes


@pytest.mark.parametrize("text", ["", "1h", "10:60", "1:61:00", "-5", "1-2-3", "30\n"])
def test_bad_time_limits(text):
    assert slurm_minutes(text) is None


def test_submitit_is_pinned_to_the_range_that_is_tested():
    """hpc/slurm.py renders the script with a private function of submitit: the package's requirement admits the
    version the tests run (and the golden file holds) and no later minor release, whose private API may differ."""
    from importlib.metadata import version

    import tomllib
    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[2]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [Requirement(d).specifier for d in deps if Requirement(d).name == "submitit"]
    installed = version("submitit")
    assert installed in spec and "1.6.0" not in spec, (str(spec), installed)
    cuda = [line for line in (root / "envs" / "requirements-cuda.txt").read_text().splitlines() if "submitit" in line]
    assert [str(Requirement(line).specifier) for line in cuda] == [str(spec)]


def test_the_mpi_note_stays_out_of_the_evaled_block(tmp_path):
    """sbatch/common.sh eval's everything hpc_prepare prints after #HPC-VARS: where job.mpi=auto cannot be resolved
    (no mpirun beside the Python or on PATH), the note saying so goes to stderr, and the block holds only the
    assignments (a note there would abort the eval and drop srun's arguments, the setup and the environment)."""
    # The project's Python without an mpirun beside it: a venv-like folder whose lib is the real venv's.
    venv = Path(sys.prefix)
    bare = tmp_path / "py"
    (bare / "bin").mkdir(parents=True)
    (bare / "bin" / "python").symlink_to(Path(sys.executable).resolve())
    (bare / "lib").symlink_to(venv / "lib")
    (bare / "pyvenv.cfg").write_text((venv / "pyvenv.cfg").read_text())
    root = Path(__file__).resolve().parents[2]
    script = 'source sbatch/common.sh; PATH=/nonexistent hpc_prepare train "$1"'
    env = {**os.environ, "PYTHON": str(bare / "bin" / "python"), "CONFIG": "tiny", "PYTHONPATH": str(root),
           "HPC_SET": "job.setup=['echo kept'] job.srun_args=[--cpu-bind=cores]"}  # fmt: skip
    proc = subprocess.run(["bash", "-c", script, "bash", str(tmp_path / "run")], capture_output=True, text=True,
                          env=env, cwd=root)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "note: job.mpi=auto could not be resolved" in proc.stderr, proc.stderr
    block = proc.stdout.split("#HPC-VARS", 1)[1]
    assert block.strip() and all(line.startswith("hpc_") for line in block.strip().splitlines()), block
    shown = f'{block}\necho "$hpc_mpi_cfg ${{hpc_srun_args[*]}} ${{hpc_setup[*]}}"'
    shown = subprocess.run(["bash", "-c", shown], capture_output=True, text=True)
    assert shown.stdout.strip() == "pmi2 --cpu-bind=cores echo kept", shown


def test_with_spares_the_ranks_step_has_no_mpi_and_survives_a_task_death():
    """job.spare_ranks under Slurm: the ranks are srun tasks with no MPI plugin (they meet in the keeper's store) whose
    death ends no other task; each spare is an srun step of one task on one of the launch's nodes, the last first."""
    from hpc.driver import spare_commands, srun_command

    cfg = load_config("tiny", ["job.spare_ranks=1", "job.nodes=2", "job.srun_args=[--cpu-bind=none]"])
    rundir = RunDir(Path("/RUN"))
    ranks = srun_command(cfg, rundir, ())
    assert {"--mpi=none", "--kill-on-bad-exit=0", "--no-kill"} <= set(ranks) and "--kill-on-bad-exit=1" not in ranks, (
        ranks
    )
    pairs = spare_commands(cfg, rundir, ("n1", "n2"))
    assert [node for node, _ in pairs] == ["n2", "n1"], pairs
    spares = [command for _, command in pairs]
    assert [[a for a in c if a.startswith(("--nodes", "--ntasks", "--nodelist"))] for c in spares] == [
        ["--nodes=1", "--ntasks=1", "--nodelist=n2"], ["--nodes=1", "--ntasks=1", "--nodelist=n1"]
    ], spares  # fmt: skip
    assert all("--cpu-bind=none" in c and "--mpi=none" in c and c[-3:] == ["trainer", "--run-dir", "/RUN"]
               for c in spares), spares  # fmt: skip
    plain = srun_command(load_config("tiny", ["job.nodes=2"]), rundir, ())
    assert "--kill-on-bad-exit=1" in plain and "--mpi=none" not in plain, plain
