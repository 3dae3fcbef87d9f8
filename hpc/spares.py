"""The launcher's side of in-process restarts (job.spare_ranks, torch-free): the launch's keeper and its warm
spares, started beside the ranks and ended with them.

The keeper (``python -m trainer.parallel.keeper``) gets its two listening sockets from here, bound before anything
starts (no port race, and the ranks' address is known at once); the store's key is made here and handed to the
keeper, the ranks and the spares in their environment only. A spare (``python -m trainer --spare N``) imports and
waits for a place.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

from runconfig import RunConfig
from rundir import RunDir
from rundir.contract import KEEPER_VAR, STORE_KEY_VAR

NETMOD_VAR = "MPIR_CVAR_CH4_NETMOD"

#: seconds the launcher waits, once mpirun ended, for the spares that took places to finish (their ranks' work)
FINISH_S = 600.0


class Spares:
    """The keeper and the spares of one launch; ``env`` (the ranks' environment) gains the keeper's address and
    the store's key."""

    def __init__(self, cfg: RunConfig, rundir: RunDir, env: dict, world_size: int, addr: str = "127.0.0.1") -> None:
        self.procs: list[subprocess.Popen] = []
        key = secrets.token_bytes(32).hex()
        store, live = _listener(addr), _listener(addr)
        env[KEEPER_VAR] = f"{addr}:{store.getsockname()[1]}:{live.getsockname()[1]}"
        env[STORE_KEY_VAR] = key
        # MPICH's OFI network module (the trainer's default, trainer/parallel/mpi_library.py) ends every rank when
        # one dies, long after MPI's last use; UCX leaves them be (docs/measurements/notes-trainer.md). Under hydra
        # UCX's long business cards are no problem.
        env.setdefault(NETMOD_VAR, "ucx")
        logs = rundir.logs if rundir.logs.is_dir() else Path(os.devnull).parent
        python = [sys.executable, "-u", "-m"]
        keeper = [*python, "trainer.parallel.keeper", "--store-fd", str(store.fileno()), "--live-fd",
                  str(live.fileno()), "--addr", addr, "--world", str(world_size), "--max-restarts",
                  str(cfg.job.max_failures)]  # fmt: skip
        try:
            self.keeper = self._start(keeper, env, logs / "keeper.log", (store.fileno(), live.fileno()))
        finally:
            store.close()  # the keeper holds its own copies
            live.close()
        for n in range(cfg.job.spare_ranks):
            command = [*python, "trainer", "--run-dir", str(rundir.root), "--spare", str(n)]
            self.procs.append(self._start(command, env, logs / f"spare_{n}.log", ()))

    def _start(self, command: list[str], env: dict, log: Path, fds: tuple[int, ...]) -> subprocess.Popen:
        with open(log, "ab") as out:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, pass_fds=fds,
                                    start_new_session=True)  # fmt: skip

    def finish(self, timeout_s: float = FINISH_S) -> None:
        """After mpirun ended: the keeper ends once every rank (spares that took a place included) has ended, and
        tells the idle spares to go; what is still running after ``timeout_s`` is killed."""
        deadline = time.monotonic() + timeout_s
        for proc in [self.keeper, *self.procs]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for proc in [self.keeper, *self.procs]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _listener(addr: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, 0))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock
