"""The non-blocking barrier every start-up meeting (and an error's last meeting) goes through."""

from mpi4py import MPI

from trainer.env import patient_allgather, patient_barrier


def test_one_rank_meets_at_once_with_or_without_a_timeout():
    assert patient_barrier(MPI.COMM_WORLD) is True
    assert patient_barrier(MPI.COMM_WORLD, poll_s=0.005, timeout_s=1.0) is True
    assert patient_allgather(MPI.COMM_WORLD, "x") == ["x"] * MPI.COMM_WORLD.Get_size()
