"""The SLURM_* values the driver and the trainer's ranks both read are parsed once, so they agree."""

from pathlib import Path

import pytest
from mpi4py import MPI

from hpc import slurmctl
from hpc.driver import SlurmJob
from rundir.slurmvars import slurm_conf, slurm_job_nodes, slurm_restart_count
from trainer.env import from_mpi


@pytest.mark.parametrize(
    ("environ", "count"),
    [
        ({}, None),  # not a Slurm job
        ({"SLURM_JOB_ID": "7"}, 0),  # a first run: Slurm sets the count only once the job is requeued
        ({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2"}, 2),
        ({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "x"}, 0),
    ],
)
def test_the_driver_and_the_ranks_read_the_same_restart_count(environ, count):
    assert slurm_restart_count(environ) == count
    env = from_mpi(MPI.COMM_WORLD, environ=environ)
    assert env.slurm_restart_count == count
    assert env.slurm_job_id == environ.get("SLURM_JOB_ID")
    if "SLURM_JOB_ID" in environ:  # the driver runs in a Slurm job only
        assert SlurmJob.from_environ(environ).restart_count == env.slurm_restart_count


def test_the_jobs_nodes_and_the_cluster_config_are_read_in_one_place(tmp_path):
    environ = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "n[1-4]"}
    assert slurm_job_nodes(environ) == (4, "n[1-4]") and slurm_job_nodes({}) == (None, "")
    job = SlurmJob.from_environ(environ)
    assert (job.num_nodes, job.nodelist) == (4, "n[1-4]")
    assert SlurmJob.from_environ({"SLURM_JOB_ID": "7"}).num_nodes == 1
    assert slurm_conf({}) == Path("/etc/slurm/slurm.conf")
    conf = tmp_path / "slurm.conf"
    assert slurm_conf({"SLURM_CONF": str(conf)}) == conf
    assert not slurmctl.available({"SLURM_CONF": str(conf)})  # no such file: not a cluster, sbatch or not
