"""The launch's keeper (job.spare_ranks): a process of its own, started by the launcher beside the ranks, that
holds the rendezvous store (so that no rank's death takes it down) and watches every rank and spare by a socket
each holds open to it. A socket closed without a goodbye is a dead process, known at once: the keeper puts a warm
spare in its place and writes the next generation's plan to the store, sealed with the launch's key, for the
survivors and the spare (trainer/parallel/rejoin.py). With no spare left, or past the restart cap, the plan says
to fall back (the survivors end the launch and the launcher restarts it).

    python -m trainer.parallel.keeper --store-fd FD --live-fd FD --addr ADDR --world N --max-restarts M \
        --run-dir RUN --spares K --spare-commands JSON

It keeps K warm spares (the launcher's trainer command with ``--spare N``; under Slurm an srun step on one of the
launch's nodes) ready: one that takes a place is replaced at once, importing while the ranks go on. When every rank
has said goodbye or died, it tells the idle spares to go. On SIGTERM (the launch is ending) it plans nothing more and
keeps the store for the ranks still stopping, until they are gone or the launcher says it ended (SIGUSR1).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from rundir.contract import SPAWN_RANK_VAR, SPAWN_WORLD_VAR, STORE_KEY_VAR
from trainer.parallel.storeseal import Seal

log = logging.getLogger("keeper")

KEEPER_RANK = -1  # the keeper's writer id in sealed values
GATHER_S = 0.1  # after a first death, how long more deaths are gathered into the same plan (a node's ranks)
HELLO_S = 5.0  # a new connection's time to prove it holds the launch's key
MAX_PENDING = 256  # connections not yet proven; more are closed at once


def plan_key(gen: int) -> str:
    return f"hpc/rejoin/plan/{gen}"


def assign_key(spare: int) -> str:
    return f"hpc/rejoin/spare/{spare}"


#: where rank 0 leaves the launch's layout for the ranks and the spares (trainer/startup/boot.py), sealed like the
#: plans, from each rank's place under ``where_key``
LAYOUT_KEY = "hpc/rejoin/layout"


def where_key(rank: int) -> str:
    return f"hpc/rejoin/where/{rank}"


def proof(secret: bytes, nonce: str, role: str, ident: int, node: str) -> str:
    """What a member sends to show it holds the launch's key (a stranger's socket must not pose as a rank whose
    close would set off a restart)."""
    return hmac.new(secret, f"{nonce}|{role}|{ident}|{node}".encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class KeeperAddress:
    addr: str
    store_port: int
    live_port: int

    @classmethod
    def parse(cls, text: str) -> KeeperAddress:
        addr, store, live = text.rsplit(":", 2)
        return cls(addr, int(store), int(live))


@dataclass
class Member:
    role: str  # "rank" or "spare"
    ident: int  # the rank, or the spare's number
    sock: socket.socket
    node: str = ""  # the node it runs on (Slurm's name, else the host's)
    addr: str = ""  # its address, as the keeper sees it
    launched: bool = False  # one of the launcher's own rank processes (not a spare that took a place)
    bye: bool = False  # it said goodbye ("bye": done; "fail": it ended the launch on purpose)
    buffer: bytes = b""
    heard: float = field(default_factory=time.monotonic)  # its last word (a beat, every monitor.heartbeat_s)
    silent: bool = False  # counted dead for its silence (a lost node, a stopped process), its socket still open
    died: float = 0.0  # when it was counted dead (monotonic)


@dataclass
class Keeper:
    secret: bytes
    world: int
    max_restarts: int
    store: object  # the TCPStore server (this process holds it)
    live: socket.socket
    spawn: Callable[[], None] = lambda: None  # start one more warm spare (one took a place)
    silence_s: float = 0.0  # a member unheard this long is counted dead (monitor.peer_timeout_s; 0: never)
    gen: int = 0
    restarts: int = 0
    members: dict[int, Member] = field(default_factory=dict)  # by socket fd
    pending: dict[int, tuple[socket.socket, str, float]] = field(default_factory=dict)  # fd -> (sock, nonce, since)
    dead: dict[int, Member] = field(default_factory=dict)  # rank -> its member, counted dead, not yet planned for
    lost_nodes: set[str] = field(default_factory=set)  # nodes whose members went silent: no new spare goes there
    done: bool = False
    gen_started: bool = False  # a rank has said hello
    launcher_done: bool = False  # mpirun, and with it the launcher's own rank processes, ended (SIGUSR1)
    fallen: bool = False  # a plan said to fall back: the launch ends, no further plans
    seal: Seal = field(init=False)
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)

    def __post_init__(self) -> None:
        self.seal = Seal(self.secret, KEEPER_RANK)
        self.selector.register(self.live, selectors.EVENT_READ)

    def _put(self, key: str, value: dict) -> None:
        self.store.set(key, self.seal.seal(key, json.dumps(value, sort_keys=True)))

    def ranks(self) -> dict[int, Member]:
        return {m.ident: m for m in self.members.values() if m.role == "rank"}

    def idle_spares(self) -> list[Member]:
        return sorted((m for m in self.members.values() if m.role == "spare"), key=lambda m: m.ident)

    def step(self, timeout: float) -> None:
        """One wait for sockets: accept, check hellos, read goodbyes and closes; plan once deaths are gathered. A
        socket's trouble (garbage, a reset) ends that socket, never the keeper."""
        now = time.monotonic()
        for key, _ in self.selector.select(timeout):
            sock = key.fileobj
            try:
                if sock is self.live:
                    self._accept()
                elif sock.fileno() in self.pending:
                    self._hello(sock)
                elif sock.fileno() in self.members:
                    self._read(sock, now)
            except Exception as exc:  # noqa: BLE001 (one connection's fault)
                log.warning("keeper: a connection failed (%s: %s); closed", type(exc).__name__, exc)
                self._forget(sock)
        for sock, _, since in list(self.pending.values()):
            if now - since > HELLO_S:
                self._forget(sock)
        if self.silence_s and not self.fallen:
            self._count_silent(now)
        if self.dead and now - min(m.died for m in self.dead.values()) >= GATHER_S:
            self._plan()
        if self.gen_started and not self.dead and not self.ranks():
            self.done = True  # every rank said goodbye or died
        if self.launcher_done:  # mpirun ended: every generation holds one of its ranks, so the launch is over (the
            self.done = True  # spares still running, if any, end with the keeper: SparePool.end)

    def _count_silent(self, now: float) -> None:
        """Members unheard for ``silence_s`` (their node lost: no close ever comes; or the process stopped) are
        counted dead, and with them the members of their node unheard for half that (beats come every
        monitor.heartbeat_s, at most a third of it: those are gone too), so that a node's ranks, whose beats drift
        apart, go in one plan; they are told so, should they ever read it."""
        silent = [m for m in self.members.values() if not m.bye and now - m.heard > self.silence_s]
        nodes = {m.node for m in silent}
        silent += [m for m in self.members.values() if m not in silent and not m.bye and m.node in nodes
                   and now - m.heard > self.silence_s / 2]  # fmt: skip
        for member in silent:
            log.warning("keeper: %s %d on %s unheard for %.1f s (node lost, link down or process stopped): counted "
                        "dead", member.role, member.ident, member.node, now - member.heard)  # fmt: skip
            with contextlib.suppress(OSError):
                member.sock.send(b"gone\n")
            member.silent = True
            self._forget(member.sock)
            if member.role == "rank":
                self._died(member, now)

    def _died(self, member: Member, now: float) -> None:
        member.died = now
        self.dead[member.ident] = member

    def _forget(self, sock: socket.socket) -> None:
        with contextlib.suppress(Exception):
            self.selector.unregister(sock)
        self.pending.pop(sock.fileno(), None)
        self.members.pop(sock.fileno(), None)
        with contextlib.suppress(OSError):
            sock.close()

    def _accept(self) -> None:
        sock, _ = self.live.accept()
        if len(self.pending) >= MAX_PENDING:  # a flood of connections that never prove anything
            sock.close()
            return
        sock.setblocking(False)
        nonce = secrets.token_hex(16)
        sock.send(f"{nonce}\n".encode())
        self.pending[sock.fileno()] = (sock, nonce, time.monotonic())
        self.selector.register(sock, selectors.EVENT_READ)

    def _hello(self, sock: socket.socket) -> None:
        _, nonce, _ = self.pending[sock.fileno()]
        role, ident_text, node_text, mac = sock.recv(512).split()
        ident = int(ident_text)
        role, node = role.decode("ascii"), node_text.decode("ascii")
        if role not in ("rank", "spare") or not hmac.compare_digest(
            mac, proof(self.secret, nonce, role, ident, node).encode()
        ):
            log.warning("keeper: a connection that does not hold the launch's key was refused")
            return self._forget(sock)
        del self.pending[sock.fileno()]
        self.members[sock.fileno()] = Member(role, ident, sock, node=node, addr=_peer(sock), launched=role == "rank")
        if role == "rank":
            self.gen_started = True
        else:
            log.info("keeper: spare %d waits on %s", ident, node)
        sock.send(b"ok\n")

    def _read(self, sock: socket.socket, now: float) -> None:
        member = self.members[sock.fileno()]
        try:
            data = sock.recv(256)
        except OSError:
            data = b""
        if data:
            member.heard = now
            member.buffer = (member.buffer + data)[-64:]
            if b"fail" in member.buffer and not member.bye and member.role == "rank" and not self.fallen:
                self._fall_back(f"rank {member.ident} ended the launch")
            member.bye = member.bye or b"bye" in member.buffer or b"fail" in member.buffer
            return
        self._forget(sock)
        if member.role == "rank" and not member.bye and not self.fallen:
            log.warning("keeper: rank %d's process ended without a goodbye (generation %d)", member.ident, self.gen)
            self._died(member, now)
        elif member.role == "spare" and not member.bye:
            log.warning("keeper: spare %d ended while waiting", member.ident)

    def _fall_back(self, why: str, plan: dict | None = None) -> None:
        """The next generation's plan says to end the launch (the launcher restarts it)."""
        self.gen += 1
        plan = {**(plan or {}), "gen": self.gen, "world": self.world, "at": time.time(), "fallback": why}
        self.fallen = True
        self._put(plan_key(self.gen), plan)
        self._notify()
        log.warning("keeper: generation %d: %s", self.gen, json.dumps(plan, sort_keys=True))

    def _plan(self) -> None:
        """The next generation: a spare in each dead rank's place, or the fall-back."""
        dead = sorted(self.dead)
        members = [self.dead[rank] for rank in dead]
        died_at = time.time() - (time.monotonic() - min(m.died for m in members))
        self.dead.clear()
        self.restarts += 1
        lost_nodes = {m.node for m in members if m.silent}  # maybe gone with its spares: none placed there
        spares = [s for s in self.idle_spares() if s.node not in lost_nodes]
        # the dead ranks' addresses: a survivor cuts its connections there (a lost node's never close)
        addrs = {str(m.ident): m.addr for m in members}
        facts = {"dead": dead, "died_at": died_at, "silent": sorted(m.ident for m in members if m.silent),
                 "addrs": addrs, "lost_nodes": sorted(lost_nodes)}  # fmt: skip
        self.lost_nodes |= lost_nodes
        if self.restarts > self.max_restarts:
            return self._fall_back(f"in-process restarts exceed job.max_failures={self.max_restarts}", facts)
        if len(spares) < len(dead):
            return self._fall_back(f"{len(dead)} rank(s) died and {len(spares)} warm spare(s) are left", facts)
        if not any(m.launched for m in self.ranks().values()):  # the launcher follows its own rank processes
            return self._fall_back("none of the launcher's own rank processes is left", facts)
        self.gen += 1
        plan: dict = {**facts, "gen": self.gen, "world": self.world, "at": time.time(), "spares": {}}
        for rank, spare in zip(dead, _placed(members, spares), strict=False):
            plan["spares"][str(rank)] = spare.ident
            self._put(assign_key(spare.ident), {"gen": self.gen, "rank": rank})
            spare.role, spare.ident = "rank", rank  # its socket now watches that rank
            self.spawn()  # a new warm spare for the next failure, importing while the ranks go on
        self._put(plan_key(self.gen), plan)
        self._notify()
        log.warning("keeper: generation %d: %s", self.gen, json.dumps(plan, sort_keys=True))

    def close_spares(self) -> None:
        """Tell the spares still waiting that no place will come."""
        for spare in self.idle_spares():
            with contextlib.suppress(Exception):
                self._put(assign_key(spare.ident), {"close": True})
        self._notify()

    def _notify(self) -> None:
        """Every member told to look in the store (a plan, a place or a close is there): their watches block on
        these sockets rather than in timed waits in the store. A socket that cannot take the line is skipped (its
        owner finds the news when it looks)."""
        for member in list(self.members.values()):
            with contextlib.suppress(OSError):
                member.sock.send(b"look\n")


def plain_address(text: str) -> str:
    """An address as /proc/net/tcp6 reads back an IPv4-mapped one: as IPv4 (the keeper and the ranks compare them)."""
    return text.removeprefix("::ffff:")


def _peer(sock: socket.socket) -> str:
    try:
        return plain_address(str(sock.getpeername()[0]))
    except OSError:  # already closed
        return ""


def _placed(members: list[Member], spares: list[Member]) -> list[Member]:
    """A spare for each dead member, in order: first one on its own node for each whose process died (not its node),
    then the first left for the rest; as many as there are spares."""
    left = list(spares)
    own: dict[int, Member] = {}
    for i, member in enumerate(members):
        same = next((s for s in left if s.node == member.node and not member.silent), None)
        if same is not None:
            own[i] = same
            left.remove(same)
    out = []
    for i in range(len(members)):
        choice = own.get(i) or (left.pop(0) if left else None)
        if choice is None:
            break
        out.append(choice)
    return out


def serve(args: argparse.Namespace) -> int:
    flags: dict[str, bool] = {}  # the signals' notes, set before the slow import: a signal never kills the keeper
    signal.signal(signal.SIGTERM, lambda *_: flags.update(stop=True))  # the launch is ending: no more plans
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C stops the ranks, which still need the store
    signal.signal(signal.SIGUSR1, lambda *_: flags.update(launcher_done=True))  # mpirun (srun) has ended
    import torch.distributed as dist  # the store's server; imported while the ranks start

    secret = bytes.fromhex(os.environ.pop(STORE_KEY_VAR, ""))
    if not secret:
        print(f"keeper: no {STORE_KEY_VAR} in the environment", file=sys.stderr)
        return 2
    store_sock = socket.socket(fileno=args.store_fd)
    port = store_sock.getsockname()[1]
    store = dist.TCPStore(args.addr, port, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=300), master_listen_fd=args.store_fd)  # fmt: skip
    live = socket.socket(fileno=args.live_fd)
    commands = json.loads(args.spare_commands) or [["", [sys.executable, "-u", "-m", "trainer", "--run-dir",
                                                         args.run_dir]]]  # fmt: skip
    spares = SparePool(args.run_dir, commands, args.spares, secret)
    keeper = Keeper(secret, args.world, args.max_restarts, store, live, silence_s=args.silence_s)
    keeper.spawn = lambda: spares.start(avoid=keeper.lost_nodes)
    for _ in range(args.spares):
        spares.start()
    parent, stopping = os.getppid(), False
    while not keeper.done and os.getppid() == parent:
        keeper.launcher_done = flags.get("launcher_done", False)
        if flags.get("stop") and not stopping:  # scancel, a time limit, the launcher's end: the ranks stop too, and
            stopping, keeper.fallen = True, True  # use the store while they save: it stays until they are gone
            keeper.close_spares()
        keeper.step(0.05)
    keeper.close_spares()
    spares.end()  # the idle ones read their close and go (before the store does); any left are killed
    return 0


class SparePool:
    """The warm spares this keeper started, each logging to logs/spare_N.log: spare N runs the next of ``commands``
    in turn, (node, command line) pairs (the launcher's trainer command; under Slurm an srun step on that node), with
    ``--spare N``; the launch's store key is handed over in their environment only."""

    def __init__(self, run_dir: str, commands: list[list], count: int, secret: bytes) -> None:
        self.run_dir, self.commands, self.count = run_dir, commands, count
        drop = (SPAWN_RANK_VAR, SPAWN_WORLD_VAR)  # a spare is no rank until it takes a place
        self.env = {**{k: v for k, v in os.environ.items() if k not in drop}, STORE_KEY_VAR: secret.hex()}
        self.procs: list[subprocess.Popen] = []

    def start(self, avoid: set[str] = frozenset()) -> None:
        """One more spare, on the next node in turn but those in ``avoid`` (lost); none when every node is."""
        if not self.count:
            return
        n = len(self.procs)
        turns = [self.commands[(n + i) % len(self.commands)] for i in range(len(self.commands))]
        node_command = next((c for c in turns if not c[0] or c[0] not in avoid), None)
        if node_command is None:
            log.warning("keeper: no node left for a new spare (lost: %s)", ", ".join(sorted(avoid)))
            return
        logs = os.path.join(self.run_dir, "logs")
        log_path = os.path.join(logs, f"spare_{n}.log") if os.path.isdir(logs) else os.devnull
        command = [*node_command[1], "--spare", str(n)]
        with open(log_path, "ab") as out:
            self.procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env))

    def end(self, timeout_s: float = 10.0) -> None:
        """Every spare ended: an idle one reads its close and goes; any left after ``timeout_s`` is ended (SIGTERM,
        which srun passes on to its task, then SIGKILL)."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.parallel.keeper", description=__doc__.splitlines()[0])
    parser.add_argument("--store-fd", type=int, required=True)
    parser.add_argument("--live-fd", type=int, required=True)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--spares", type=int, default=0, help="warm spares kept ready")
    parser.add_argument("--silence-s", type=float, default=0.0, help="a member unheard this long is dead (0: never)")
    parser.add_argument(
        "--spare-commands",
        default="[]",
        help="JSON: [node, command line] pairs, used in turn (default: this Python's trainer)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
