"""One rank of an MPI start exactly as the trainer does it (its MPI defaults, its progress thread, then the MPI
layout, then rank 0's broadcast followed by a wait outside MPI): prints a JSON line with what this rank learnt,
with the names of the MPI shared-memory segments it has mapped, so that a test can tell its own segments from those
of another test running beside it."""

import json
import socket
import time

from trainer.parallel.mpi_library import apply_defaults

apply_defaults()

from mpi4py import MPI  # noqa: E402

from storage import shm  # noqa: E402
from trainer.env import from_mpi  # noqa: E402
from trainer.parallel.mpi_progress import ProgressThread  # noqa: E402


def mapped_segments() -> list[str]:
    """Names of this process's mappings in /dev/shm with an MPI segment's prefix (storage/shm.py), unlinked or not."""
    prefix = f"{shm.SHM_DIR}/"
    names = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix):
                name = fields[5].rstrip("\n").removesuffix(" (deleted)")[len(prefix) :]
                if name.startswith(shm.PREFIXES):
                    names.add(name)
    return sorted(names)


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
record["segments"] = mapped_segments()
print(json.dumps(record), flush=True)
if progress is not None:
    progress.stop()
