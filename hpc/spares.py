"""The launcher's side of in-process restarts (job.spare_ranks, torch-free): the launch's keeper, which keeps the
warm spares, started beside the ranks and ended with them.

The keeper (``python -m trainer.parallel.keeper``) gets its two listening sockets from here, bound before anything
starts (no port race, and the ranks' address is known at once); the store's key is made here and handed to the
keeper and the ranks in their environment only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

from runconfig import RunConfig
from rundir import RunDir
from rundir.contract import KEEPER_VAR, STORE_KEY_VAR

#: seconds the launcher waits, once mpirun ended, for the keeper to end (it gives the spares 10 s, then kills them)
FINISH_S = 60.0


class Spares:
    """The keeper and the spares of one launch; ``env`` (the ranks' environment) gains the keeper's address and
    the store's key."""

    def __init__(
        self,
        cfg: RunConfig,
        rundir: RunDir,
        env: dict,
        world_size: int,
        spare_commands: list[list],
        addr: str = "127.0.0.1",
    ) -> None:
        """``spare_commands``: the spares' (node, command line) pairs, used in turn (the trainer's, under Slurm in an
        srun step on that node; node "" locally); ``addr``: where the ranks reach the keeper (this host's loopback
        for local runs, the batch host's cluster address under Slurm)."""
        key = secrets.token_bytes(32).hex()
        store, live = _listener(addr), _listener(addr)
        env[KEEPER_VAR] = f"{addr}:{store.getsockname()[1]}:{live.getsockname()[1]}"
        env[STORE_KEY_VAR] = key
        log = rundir.logs / "keeper.log" if rundir.logs.is_dir() else Path(os.devnull)
        command = [sys.executable, "-u", "-m", "trainer.parallel.keeper", "--store-fd", str(store.fileno()),
                   "--live-fd", str(live.fileno()), "--addr", addr, "--world", str(world_size), "--max-restarts",
                   str(cfg.job.max_failures), "--run-dir", str(rundir.root), "--spares",
                   str(cfg.job.spare_ranks), "--silence-s", str(cfg.monitor.peer_timeout_s), "--spare-commands",
                   json.dumps(spare_commands)]  # fmt: skip
        try:
            with open(log, "ab") as out:
                fds = (store.fileno(), live.fileno())
                # In the launcher's process group: a Ctrl-C reaches the spares too (a stop for one that took a place);
                # the keeper itself ignores it and stays while the ranks stop.
                self.keeper = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, pass_fds=fds)
        finally:
            store.close()  # the keeper holds its own copies
            live.close()

    def finish(self, timeout_s: float = FINISH_S) -> None:
        """After mpirun ended: the keeper tells the idle spares to go and ends, the spares that took a place having
        ended with the launcher's ranks (every generation holds some); what is still running after ``timeout_s`` is
        killed."""
        with contextlib.suppress(ProcessLookupError):
            self.keeper.send_signal(signal.SIGUSR1)  # mpirun ended: with no rank left (none ever came) it ends now
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.keeper.wait(timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        """The keeper ended now (it ends its idle spares first: SIGTERM, then SIGKILL after a while)."""
        if self.keeper.poll() is None:
            self.keeper.terminate()
            try:
                self.keeper.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.keeper.kill()
                self.keeper.wait()


def keeper_address(cfg: RunConfig) -> str:
    """Under Slurm, where every node reaches the keeper on the batch host: comm.master_addr, else the address this
    host's name resolves to (a loopback one only serves nodes on this host: a warning names the key to set)."""
    if cfg.comm.master_addr:
        return cfg.comm.master_addr
    addr = socket.gethostbyname(socket.gethostname())
    if ipaddress.ip_address(addr).is_loopback:
        print(f"warning: job.spare_ranks: this host's name resolves to {addr}, which other hosts cannot reach: the "
              "keeper listens there (set comm.master_addr to the batch host's cluster address)",
              flush=True)  # fmt: skip
    return addr


def _listener(addr: str) -> socket.socket:
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(sockaddr)
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock
