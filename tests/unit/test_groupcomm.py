"""trainer/parallel/groupcomm.py on a real gloo world of 3 processes: every MPI.Comm call the trainer makes, with
rank-dependent values, checked on every rank; a rank with another launch's secret is named by the others and nothing
of its is unpickled; Abort flushes and ends the process (MPI's branch chosen only when MPI is up)."""

import multiprocessing
import os
import pickle
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from mpi4py import MPI

from trainer.parallel import groupcomm
from trainer.parallel.groupcomm import GroupComm

WORLD = 3
SECRET = b"this launch's secret"
TIMEOUT = timedelta(seconds=5)  # gloo's: a rank left waiting on a failed peer gives up, never hangs the test


def value(rank: int) -> dict:
    return {"rank": rank, "pair": (rank, f"r{rank}"), "none": None, "third": rank / 3, "nested": [(rank,), {rank}]}


def join(ctx: mp.ProcessContext, timeout_s: float) -> None:
    """Join the processes (a child's exception re-raised here); kill them and fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=0.2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the ranks did not end within {timeout_s} s")


def start(worker, *args) -> None:
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    ctx = mp.start_processes(worker, args=(store.port, *args), nprocs=WORLD, join=False,
                             start_method="fork" if sys.platform == "linux" else "spawn")  # fmt: skip
    join(ctx, timeout_s=90)


def connect(rank: int, port: int) -> float:
    """Join the gloo world once every rank has come (a loaded machine may start them seconds apart, which is not what
    TIMEOUT bounds); the time all were here is returned."""
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=60))
    store.add("arrived", 1)
    deadline = time.monotonic() + 60
    while store.add("arrived", 0) < WORLD:
        assert time.monotonic() < deadline, "the other ranks never came"
        time.sleep(0.02)
    here = time.monotonic()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    return here


def every_call(rank: int, port: int) -> None:
    connect(rank, port)
    comm = GroupComm(None, SECRET)
    assert (comm.Get_rank(), comm.rank, comm.Get_size(), comm.size) == (rank, rank, WORLD, WORLD)

    mine = value(rank)
    got = comm.allgather(mine)
    assert got == [value(r) for r in range(WORLD)]
    assert got[rank] is not mine  # a copy, as mpi4py's

    sent = value(1) if rank == 1 else None
    got = comm.bcast(sent, root=1)
    assert got == value(1) and got is not sent
    assert comm.bcast(None if rank else (None, 0.25)) == (None, 0.25)  # root 0 by default

    got = comm.gather(mine, root=2)
    assert got == ([value(r) for r in range(WORLD)] if rank == 2 else None)
    assert comm.gather(rank * 10) == ([0, 10, 20] if rank == 0 else None)

    assert comm.allreduce(rank + 0.5, op=MPI.MAX) == 2.5
    assert comm.allreduce((rank - 1) * 1.5, op=MPI.MIN) == -1.5
    assert comm.allreduce(rank + 1, op=MPI.SUM) == 6
    assert comm.allreduce([rank]) == [0, 1, 2]  # SUM by default, folded in rank order
    with pytest.raises(ValueError, match="unsupported op"):
        comm.allreduce(rank, op=MPI.PROD)  # refused on every rank before any exchange

    comm.barrier()
    comm.Barrier()
    if rank == 2:  # the last one in: the others' barrier is not done before it comes
        time.sleep(1.0)
        comm.Ibarrier().Wait()
    else:
        request = comm.Ibarrier()
        assert request.Test() is False
        deadline = time.monotonic() + 4
        while not request.Test():
            assert time.monotonic() < deadline, "Ibarrier never completed"
            time.sleep(0.01)
        request.Wait()
    assert comm.allgather(rank) == [0, 1, 2]  # the counters still agree after the barriers
    comm.Free()

    # a subgroup: its ranks renumbered from 0, its roots translated to the world's ranks
    sub = dist.new_group([1, 2])  # every rank of the world makes it
    if rank in (1, 2):
        part = GroupComm(sub, SECRET)
        assert (part.rank, part.size) == (rank - 1, 2)
        assert part.bcast(rank if rank == 2 else None, root=1) == 2
        assert part.allgather(value(rank)) == [value(1), value(2)]
        assert part.gather(rank, root=1) == ([1, 2] if rank == 2 else None)

    # a payload is bound to its sender and its call
    sealed = comm._seal(mine, 7)
    assert pickle.loads(comm._check(sealed, rank, 7, "allgather")) == mine
    for sender, call, payload in [(rank, 8, sealed), ((rank + 1) % WORLD, 7, sealed), (rank, 7, sealed[:-1] + b"!")]:
        with pytest.raises(RuntimeError, match=f"rank {sender}'s payload in GroupComm.allgather failed its check"):
            comm._check(payload, sender, call, "allgather")
    dist.destroy_process_group()


def test_every_call_on_three_ranks():
    start(every_call)


class Bomb:
    def __reduce__(self):
        return os._exit, (99,)  # unpickled anywhere, the process would end with 99


def other_secret(rank: int, port: int, out: str) -> None:
    here = connect(rank, port)
    comm = GroupComm(None, b"another launch" if rank == 1 else SECRET)
    seen = []
    # the stranger's Bomb would end whoever unpickled it; its own broadcast it opens itself, so a harmless one there
    for call in (lambda: comm.allgather(Bomb() if rank == 1 else rank), lambda: comm.bcast(value(rank), root=1)):
        try:
            call()
            seen.append("fine")
        except RuntimeError as e:
            seen.append(str(e))
    with open(f"{out}.{rank}", "w") as f:
        f.write("\n".join(seen))
    with open(f"{out}.{rank}.s", "w") as f:
        f.write(str(time.monotonic() - here))
    dist.destroy_process_group()


def test_a_rank_with_another_secret_is_named_and_never_unpickled(tmp_path):
    out = str(tmp_path / "out")
    start(other_secret, out)
    # no rank waited out gloo's timeout for a peer that had given up
    assert all(float((tmp_path / f"out.{r}.s").read_text()) < TIMEOUT.total_seconds() for r in range(WORLD))
    seen = {r: (tmp_path / f"out.{r}").read_text().split("\n") for r in range(WORLD)}
    named = "rank {}'s payload in GroupComm.{} failed its check: not written by this launch's ranks"
    for r in (0, 2):
        assert seen[r] == [named.format(1, "allgather"), named.format(1, "bcast")]
    # the stranger finds rank 0's payload the first to fail; its own broadcast holds under its own secret
    assert seen[1] == [named.format(0, "allgather"), "fine"]


def aborts(how: str, path: str) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm = GroupComm(None, SECRET)
    sys.stdout = open(path, "w", buffering=1 << 20)  # noqa: SIM115 (left unflushed on purpose)
    print("unflushed", end="")
    world = SimpleNamespace(Abort=lambda status: (print(" via MPI", end=""), sys.stdout.flush(), os._exit(status + 1)))
    up = {"mpi": (True, False), "finalized": (True, True), "none": (False, False)}[how]
    groupcomm.MPI = SimpleNamespace(Is_initialized=lambda: up[0], Is_finalized=lambda: up[1], COMM_WORLD=world)
    comm.Abort(7)


@pytest.mark.parametrize("how, status, text", [("none", 7, "unflushed"), ("finalized", 7, "unflushed"),
                                                ("mpi", 8, "unflushed via MPI")])  # fmt: skip
def test_abort_flushes_and_ends_the_process(tmp_path, how, status, text):
    path = str(tmp_path / "stdout")
    child = multiprocessing.get_context("fork").Process(target=aborts, args=(how, path))
    child.start()
    child.join(timeout=10)
    if child.exitcode is None:
        child.kill()
        pytest.fail("Abort did not end the process")
    assert child.exitcode == status
    with open(path) as f:
        assert f.read() == text
