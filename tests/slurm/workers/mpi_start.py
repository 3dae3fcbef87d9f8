"""One rank of an MPI start exactly as the trainer does it (its MPI defaults, its progress thread, then the MPI
layout, then rank 0's broadcast followed by a wait outside MPI): prints a JSON line with what this rank learnt."""

import json
import socket
import time

from trainer.parallel.mpi_library import apply_defaults

apply_defaults()

from mpi4py import MPI  # noqa: E402

from trainer.env import from_mpi  # noqa: E402
from trainer.parallel.mpi_progress import ProgressThread  # noqa: E402

comm = MPI.COMM_WORLD
progress = ProgressThread.start_if_needed(comm)
env = from_mpi(comm)
ranks = comm.allgather(env.rank)

# The trainer's rendezvous: rank 0 broadcasts a port, then waits outside MPI (in torch's TCPStore) for the others
# to connect. A transport that moves data only inside MPI calls never delivers the broadcast, and this times out.
server = None
if env.rank == 0:
    server = socket.create_server(("", 0))
    server.settimeout(20)
port = comm.bcast(server.getsockname()[1] if server else None, root=0)
start = time.monotonic()
if server:
    for _ in range(env.world_size - 1):
        server.accept()[0].close()
    waited = time.monotonic() - start
else:
    socket.create_connection((env.hosts[0], port), timeout=20).close()
    waited = 0.0
record = {"rank": env.rank, "world": env.world_size, "node": env.slurm_node, "ranks": ranks, "waited_s": waited}
print(json.dumps(record), flush=True)
if progress is not None:
    progress.stop()
