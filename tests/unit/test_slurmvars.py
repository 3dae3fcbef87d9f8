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


def test_ranks_without_mpi_take_their_rank_from_srun_and_meet_for_the_layout():
    """job.spare_ranks under Slurm: srun with no MPI plugin numbers the tasks (SLURM_PROCID); the layout rank 0 makes
    from every rank's place has Slurm's node index and names, each host's local ranks, and one network only where
    every rank shares host and network namespace."""
    from trainer.env import from_spawn, spawned_layout
    from trainer.errors import UserError

    environ = {"SLURM_PROCID": "3", "HPC_SPAWN_WORLD": "4", "SLURM_JOB_ID": "7"}
    own = from_spawn(environ)
    assert (own.rank, own.world_size) == (3, 4)
    with pytest.raises(UserError, match="outside the launch's world of 4"):
        from_spawn({**environ, "SLURM_PROCID": "4"})
    places = [{"host": h, "net": f"net:{h}", "node_id": n, "node": f"n{n + 1}"}
              for h, n in (("a", 0), ("a", 0), ("b", 1), ("b", 1))]  # fmt: skip
    layout = spawned_layout(places, {})
    assert layout["node_ids"] == [0, 0, 1, 1] and layout["node_names"] == ["n1", "n1", "n2", "n2"]
    assert layout["host_local"] == [(0, 2), (1, 2), (0, 2), (1, 2)] and not layout["one_network"]
    env = own.as_rank(3, layout)
    assert (env.node, env.local_rank, env.host_local_rank, env.node_names[3]) == (1, 1, 1, "n2")
    # Slurm's fake nodes on one host (the test cluster): Slurm's node index still tells the nodes apart
    same_host = [{**p, "host": "a", "net": "net:a"} for p in places]
    layout = spawned_layout(same_host, {})
    assert layout["node_ids"] == [0, 0, 1, 1] and layout["host_local"][3] == (3, 4) and layout["one_network"]
    with pytest.raises(UserError, match="impossible topology"):
        spawned_layout([{**places[0], "node_id": i % 2} for i in range(3)], {})
