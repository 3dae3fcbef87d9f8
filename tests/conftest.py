"""Shared fixtures: a small real dataset prepared once, an isolated data cache, and an mpirun helper."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rundir.contract import DATA_CACHE_VAR, EVENT_START
from rundir.paths import read_jsonl
from tracking import TRACKING_VAR

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


#: The Slurm test modules of the second Slurm unit: about half of the Slurm tests' time (each unit's worker starts
#: clusters of its own, on its own ports: tests/slurm/conftest.py).
SLURM_SECOND_UNIT = {
    "tests/slurm/test_accounting.py",
    "tests/slurm/test_badnodes.py",
    "tests/slurm/test_spares.py",
    "tests/slurm/test_sweep_chain.py",
}


class WorkUnits:
    """Work units for ``pytest -n N --dist loadfile`` (tests/run.sh runs three workers on two cores: with two, the
    cores were idle 14% of the time, waiting on Slurm's passes and on sleeps): the Slurm tests in two units, each
    run in file order by one worker, which starts its own clusters (their ports moved by the worker's number), every
    S3 test in another (one server), and every other test module a unit of its own, so that a module's fixtures
    (its reference runs) are made once.
    (``xdist_group`` marks would say the same, but pytest 9.2's node ids lose them: pytest-xdist issue 1386.)"""

    def pytest_xdist_make_scheduler(self, config, log):
        if config.getvalue("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadFileScheduling

        class Units(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                path = nodeid.split("::", 1)[0]
                if path in SLURM_SECOND_UNIT:
                    return "tests/slurm/ (separate hosts, sweeps, accounting)"
                for shared in ("tests/slurm/", "tests/s3/"):  # a worker's clusters, one S3 server per session
                    if path.startswith(shared):
                        return shared
                return path

        return Units(config, log)

    def pytest_collection_modifyitems(self, items) -> None:
        """Long units first, short ones last (the longest-first rule; tests/run.sh keeps this order with
        --no-loadscope-reorder): the two Slurm units start at once, the multi-process modules follow, and the
        single-process modules, seconds each, fill the workers' ends, so that none waits long for another's last
        module."""
        group = {"tests/slurm/": 0, "tests/unit/": 2}
        items.sort(key=lambda item: next((g for p, g in group.items() if item.nodeid.startswith(p)), 1))


def pytest_configure(config) -> None:
    if config.pluginmanager.hasplugin("xdist"):  # its hooks exist only then
        config.pluginmanager.register(WorkUnits(), "hpc-work-units")


def mpirun_path() -> str:
    here = Path(PY).parent / "mpirun"
    return str(here) if here.exists() else "mpirun"


def run_mpi(n: int, args: list[str], *, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on n ranks under the pip-installed MPI; nodes simulated via ``env``."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p)
    full_env.update(env or {})
    return subprocess.run(
        [mpirun_path(), "-n", str(n), PY, "-u", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
    )


def rank_results(folder: Path) -> list[dict]:
    """The per-rank JSON files a worker script wrote (rank_N.json), in rank order."""
    files = sorted(folder.glob("rank_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(f.read_text()) for f in files]


def summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def history(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "history.jsonl").read_text().splitlines()]


def run_cli(args: list[str], *, timeout: float = 600, cwd: Path = ROOT, preexec_fn=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([PY, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd,
                          preexec_fn=preexec_fn)  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def tracking_off_by_default():
    """Runs track nothing (tracking.backend auto) unless a test asks for a tracker: each new MLflow store costs rank
    0 seconds of CPU; tests/*/test_tracking*.py set tracking.backend themselves."""
    old = os.environ.get(TRACKING_VAR)
    os.environ[TRACKING_VAR] = "off"
    yield
    if old is None:
        os.environ.pop(TRACKING_VAR, None)
    else:
        os.environ[TRACKING_VAR] = old


@pytest.fixture(scope="session", autouse=True)
def isolated_data_cache(tmp_path_factory):
    """Datasets prepared on first use go to a per-session folder, not the user's ~/.cache."""
    old = os.environ.get(DATA_CACHE_VAR)
    os.environ[DATA_CACHE_VAR] = str(tmp_path_factory.mktemp("data-cache"))
    yield Path(os.environ[DATA_CACHE_VAR])
    if old is None:
        os.environ.pop(DATA_CACHE_VAR, None)
    else:
        os.environ[DATA_CACHE_VAR] = old


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> Path:
    """About 2 MB of real text (the standard library's sources) prepared into several shards."""
    from trainer.data.prepare import PrepareSpec, prepare

    out = tmp_path_factory.mktemp("small") / "data"
    spec = PrepareSpec(
        source="stdlib", include=("*.py",), max_source_bytes=2_000_000, val_fraction=0.1, shard_tokens=400_000
    )
    prepare(spec, out)
    return out


@pytest.fixture(scope="session")
def tiny_data(isolated_data_cache) -> Path:
    """The tiny example's own dataset (all of the standard library's *.py, ~60 MB of shards), prepared once per
    session into the isolated data cache, in the folder where its runs look for it: the runs that use it then pay for
    neither the preparation nor, while rank 0 prepares, the other ranks' wait in MPI (which busy-polls)."""
    worker = ROOT / "tests" / "mp" / "workers" / "prepare_cached_data.py"
    proc = run_cli([str(worker), "tiny"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = Path(proc.stdout.strip())
    assert folder.parent == isolated_data_cache and (folder / "manifest.json").is_file(), folder
    return folder


@pytest.fixture(scope="session")
def tiny_startup_s(tmp_path_factory, small_dataset) -> float:
    """This machine's normal start-up of a tiny local launch (the tiny preset on 2 simulated nodes x 1 rank), as
    monitor.startup_timeout_s counts it: from the ranks' process start through the rendezvous (its start event's
    imports, mpi and rendezvous phases), measured once per worker, beside whatever the other worker runs. Tests set
    the limits a normal launch must meet as a multiple of it, not as a guess at this machine's speed."""
    run_dir = tmp_path_factory.mktemp("startup") / "run"
    sets = [f"data.path={small_dataset}", "train.steps=1", "train.eval_every=0", "model.d_model=64",
            "model.n_layers=2", "model.seq_len=64", "monitor.preflight=off", "job.ranks_per_node=1"]  # fmt: skip
    proc = run_cli(["-m", "hpc.submit", "tiny", "--local", "--run-dir", str(run_dir), *(f"--set={s}" for s in sets)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    phases = next(e for e in history(run_dir) if e["event"] == EVENT_START)["startup_s"]
    return phases["imports"] + phases["mpi"] + phases["rendezvous"]


def rank_pids(run_dir) -> dict[int, int]:
    """rank -> pid of the trainer processes the launcher started for this run: MPICH puts PMI_RANK in each rank's
    environment, hpc/spawn.py too; srun with no MPI plugin (job.spare_ranks) SLURM_PROCID. Warm spares (``--spare``)
    and srun are left out."""
    out = {}
    for pid in subprocess.run(
        ["pgrep", "-f", f"trainer --run-dir {run_dir}"], capture_output=True, text=True
    ).stdout.split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--spare" in argv or argv[0].endswith(b"srun"):  # a spare, or srun itself (it has the batch step's
                continue  # SLURM_PROCID)
        except OSError:
            continue
        found = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        rank = found.get(b"PMI_RANK", found.get(b"SLURM_PROCID"))
        if rank is not None and rank.isdigit() and (b"PMI_RANK" in found or b"HPC_SPAWN_WORLD" in found):
            out[int(rank)] = int(pid)
    return out


def wait_for_step(run_dir, step, proc, timeout=120) -> None:
    deadline = time.monotonic() + timeout
    path = Path(run_dir) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if any(r.get("step", 0) >= step for r in read_jsonl(path)):  # a line being written is skipped
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


#: The user projects under examples/, shortened for the tests (steps, checkpoints; dropout on, so that a resume that
#: did not restore every rank's RNG streams would not end bit-identical). Their local runs (2 simulated nodes x 2
#: ranks) are the references the interrupted local runs and the Slurm runs must reproduce bit for bit.
# comm.allreduce pinned: runs compared bit for bit must reduce in the same order (auto measures per run; the
# auto path's own bitwise resume is pinned in tests/mp/test_checkpoint.py with comm.plan_from)
EXAMPLES = {
    "digits": [
        "train.steps=40", "train.warmup_steps=4", "train.eval_every=20", "checkpoint.every_steps=4",
        "comm.allreduce=hierarchical",
    ],
    "lm_bpe": [
        "train.steps=24", "train.warmup_steps=4", "train.eval_every=12", "checkpoint.every_steps=4",
        "recipe_args.dropout=0.1", "data.max_source_bytes=1500000", "data.val_fraction=0.1",
        "comm.allreduce=hierarchical",
    ],
}  # fmt: skip


def example_args(name: str, run_dir: Path | None, *extra: str) -> list[str]:
    """``python -m hpc.submit examples/NAME/config.yaml`` with the test's overrides (run from the repository root,
    as the examples' READMEs say)."""
    args = ["-m", "hpc.submit", f"examples/{name}/config.yaml", *(["--run-dir", str(run_dir)] if run_dir else [])]
    for s in EXAMPLES[name]:
        args += ["--set", s]
    return [*args, *extra]


@pytest.fixture(scope="session")
def example_reference(tmp_path_factory):
    """name -> the run directory of the example's uninterrupted local run (run once per session)."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            run_dir = tmp_path_factory.mktemp(f"example-{name}") / "run"
            proc = run_cli(example_args(name, run_dir, "--local"))
            assert proc.returncode == 0, proc.stdout + proc.stderr
            done[name] = run_dir
        return done[name]

    return get


#: The second Unix user of the attack tests: another user of the same cluster (tests/*/test_*other_user*).
OTHER_USER = "hpc-other"


@pytest.fixture(scope="session")
def other_user() -> pwd.struct_passwd:
    """A real second Unix user, made with useradd where the suite runs as root (CI does); skipped elsewhere."""
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("making a second Unix user needs root and useradd")
    return make_other_user()


def make_other_user() -> pwd.struct_passwd:
    """The second Unix user, made if missing (root only): for a test that tries an attack as one part of it."""
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", OTHER_USER], check=False)
        return pwd.getpwnam(OTHER_USER)


def as_user(user: pwd.struct_passwd, args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``args`` run as ``user``, with only that user's group (none of root's)."""
    env = {"PATH": os.environ["PATH"], "HOME": "/tmp", "LANG": "C.UTF-8", **kwargs.pop("env", {})}
    return subprocess.run(args, user=user.pw_uid, group=user.pw_gid, extra_groups=[], env=env, capture_output=True,
                          text=True, **kwargs)  # fmt: skip


@pytest.fixture(scope="session")
def other_user_python(other_user) -> list[str]:
    """A Python the other user can run with this project's packages (torch): this interpreter where they may run it
    (a pyenv build under /root is not theirs to run), else the system's of the same version, on this venv's
    site-packages. Run it with ``as_user(..., env=OTHER_USER_ENV)``."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (os.path.realpath(sys.executable), f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        try:
            if as_user(other_user, [python, "-c", "import torch.distributed"], env=OTHER_USER_ENV).returncode == 0:
                return [python]
        except OSError:  # not theirs to run
            continue
    pytest.skip(f"no {version} that {other_user.pw_name} may run with this venv's packages")


#: The other user's environment for ``other_user_python``: this venv's packages and the project.
OTHER_USER_ENV = {"PYTHONPATH": os.pathsep.join([*(p for p in sys.path if p.endswith("site-packages")), str(ROOT)])}


@pytest.fixture
def shared_scratch():
    """A world-writable, sticky folder outside the tests' private temp folders, as a cluster's /scratch is."""
    folder = Path(tempfile.mkdtemp(prefix="hpc-scratch-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
