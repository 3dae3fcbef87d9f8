"""The MPI library's start-up defaults and the sweep of shared memory that killed ranks leave (real files, real
/proc, real processes holding them)."""

import mmap
import os
import subprocess
import sys
import textwrap
import time

from storage import shm
from storage.nodememory import run_folder
from trainer.parallel.mpi_library import DEFAULTS, NETMOD_VAR, apply_defaults, is_mpich, library_name


def test_mpi_defaults_fill_in_and_never_overwrite():
    environ = {"PATH": "/bin"}
    assert apply_defaults(environ) == DEFAULTS and environ[NETMOD_VAR] == "ofi"
    chosen = {NETMOD_VAR: "ucx"}  # the user's job.env or shell wins
    applied = apply_defaults(chosen)
    assert NETMOD_VAR not in applied and chosen[NETMOD_VAR] == "ucx" and chosen == {**DEFAULTS, NETMOD_VAR: "ucx"}
    assert apply_defaults(chosen) == {}


def test_the_mpi_library_is_named_by_its_version_string():
    """The strings the two tested libraries return (this venv's MPICH wheel; Debian's Open MPI, NUL and all)."""
    from mpi4py import MPI

    here = MPI.Get_library_version()
    assert is_mpich(here) and library_name(here).startswith("MPICH Version: ")
    ompi = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022\x00"
    assert not is_mpich(ompi) and library_name(ompi) == ompi[:-1].rstrip(",") and "\x00" not in library_name(ompi)
    assert library_name("") == "unknown"


def hold(path, how):
    """A process that keeps ``path`` open (fd) or mapped (mmap, fd closed) until killed."""
    code = textwrap.dedent(f"""
        import mmap, os, sys, time
        fd = os.open({str(path)!r}, os.O_RDWR)
        if {how!r} == "mapped":
            m = mmap.mmap(fd, 4096)
            os.close(fd)
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_sweep_removes_only_stale_segments_of_this_user(tmp_path):
    names = ["mpich_shm_dead_0", "mpich_shm_open_0", "mpich_shm_mapped_0", "other_segment"]
    for name in names:
        with open(tmp_path / name, "wb") as f:
            f.write(b"\0" * mmap.PAGESIZE)
    holders = [hold(tmp_path / "mpich_shm_open_0", "open"), hold(tmp_path / "mpich_shm_mapped_0", "mapped")]
    try:
        assert [p.name for p in shm.stale(tmp_path)] == ["mpich_shm_dead_0"]
        assert shm.stale(tmp_path, uid=os.getuid() + 1) == []  # another user's files are never candidates
        assert [p.name for p in shm.sweep(tmp_path)] == ["mpich_shm_dead_0"]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()
    time.sleep(0.1)
    # Once their holders are gone the segments are stale too (a rank killed after attaching).
    assert sorted(p.name for p in shm.sweep(tmp_path)) == ["mpich_shm_mapped_0", "mpich_shm_open_0"]
    assert [p.name for p in tmp_path.iterdir()] == ["other_segment"]


def test_sweep_command_reports_per_host(tmp_path):
    (tmp_path / "mpich_shm_dead_1").write_bytes(b"x")
    out = subprocess.run(
        [sys.executable, "-m", "hpc.shmsweep", "--dir", str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert f"removed 1 stale MPI shared-memory segment(s) from {tmp_path}" in out.stdout
    assert not (tmp_path / "mpich_shm_dead_1").exists()


def test_sweep_removes_a_runs_checkpoints_in_node_memory_and_nothing_else(tmp_path):
    """hpc.shmsweep --run-id: the run's folder of node folders under checkpoint.memory_dir goes; another run's stays,
    a run id that is not one (a path) removes nothing, and a link in the run's place is not followed."""
    run_id, other = "a" * 32, "b" * 32
    for rid in (run_id, other):
        (run_folder(tmp_path, rid) / "node0" / "step_00000001").mkdir(parents=True)
    sweep = [sys.executable, "-m", "hpc.shmsweep", "--dir", str(tmp_path), "--memory-dir", str(tmp_path)]
    out = subprocess.run([*sweep, "--run-id", run_id], capture_output=True, text=True, check=True)
    assert f"removed run {run_id[:12]}'s checkpoints in node memory" in out.stdout
    assert not run_folder(tmp_path, run_id).exists() and run_folder(tmp_path, other).is_dir()
    subprocess.run([*sweep, "--run-id", f"../{other}"], capture_output=True, text=True, check=True)
    assert run_folder(tmp_path, other).is_dir()
    target = tmp_path / "kept"
    target.mkdir()
    run_folder(tmp_path, run_id).symlink_to(target)
    subprocess.run([*sweep, "--run-id", run_id], capture_output=True, text=True, check=True)
    assert target.is_dir() and run_folder(tmp_path, run_id).is_symlink()
