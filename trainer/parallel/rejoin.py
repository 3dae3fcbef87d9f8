"""A rank's side of in-process restarts (job.spare_ranks): its link to the launch's keeper
(trainer/parallel/keeper.py), which holds the store and watches every process; the watch for the keeper's next plan,
which cuts this rank's gloo connections so that a collective blocked on a dead rank fails at once (gloo's abort
does not wake a waiting collective); and the end of a broken generation's process groups.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from trainer.errors import UserError
from trainer.observe.beats import peek
from trainer.parallel.keeper import (
    KEEPER_RANK,
    LAYOUT_KEY,
    KeeperAddress,
    assign_key,
    plain_address,
    plan_key,
    proof,
    where_key,
)
from trainer.parallel.storeseal import Seal

log = logging.getLogger(__name__)

#: gloo's words for a peer that went away, or a connection cut by the watch below
PEER_GONE = re.compile(r"closed by peer|reset by peer|Read error|Write error|Broken pipe|Connection refused|"
                       r"Socket closed", re.IGNORECASE)  # fmt: skip


class PeerLost(Exception):
    """This generation's collectives failed because a rank died; ``plan`` is the keeper's next generation."""

    def __init__(self, plan: dict) -> None:
        super().__init__(f"generation {plan.get('gen')}: {plan}")
        self.plan = plan


class KeeperLink:
    """This process's store client and watched socket at the keeper."""

    def __init__(self, where: KeeperAddress, secret: bytes, timeout_s: float, beat_s: float = 1.0) -> None:
        """``beat_s``: how often this process tells the keeper it lives (monitor.heartbeat_s): a member unheard for
        monitor.peer_timeout_s is counted dead, as on a lost node, whose sockets never close."""
        self.where, self._secret, self.beat_s = where, secret, beat_s
        self.store = dist.TCPStore(where.addr, where.store_port, None, is_master=False,
                                   timeout=timedelta(seconds=timeout_s))  # fmt: skip
        self.seal = Seal(secret, 0)
        self._sock: socket.socket | None = None
        self._quiet = threading.Event()

    def hello(self, role: str, ident: int, node: str) -> None:
        """Open the socket the keeper watches (its close without a goodbye is this process's death, as is its
        silence) and start beating on it; ``node``: where this process runs (a spare is placed off a lost node)."""
        sock = socket.create_connection((self.where.addr, self.where.live_port), timeout=30)
        nonce = _line(sock)
        node = "".join(c if c.isascii() and c.isprintable() and not c.isspace() else "_" for c in node)[:200] or "?"
        sock.sendall(f"{role} {ident} {node} {proof(self._secret, nonce, role, ident, node)}\n".encode())
        if _line(sock) != "ok":
            raise RuntimeError(
                f"the launch's keeper at {self.where.addr}:{self.where.live_port} refused {role} {ident}"
            )
        sock.settimeout(None)
        self._sock = sock
        threading.Thread(target=self._beat, args=(sock,), name="hpc-keeper-beat", daemon=True).start()

    def _beat(self, sock: socket.socket) -> None:
        while not self._quiet.wait(self.beat_s):
            try:
                sock.sendall(b"beat\n")
            except OSError:  # closed: a goodbye, or the keeper gone
                return

    @property
    def local_addr(self) -> str:
        """This process's address on its link to the keeper ("" before the hello)."""
        return self._end(0)

    @property
    def keeper_addr(self) -> str:
        """The keeper's address as this process reached it, resolved ("" before the hello)."""
        return self._end(1)

    def _end(self, which: int) -> str:
        try:
            sock = self._sock
            name = (sock.getsockname() if which == 0 else sock.getpeername()) if sock is not None else ("",)
            return plain_address(str(name[0]))
        except OSError:
            return ""

    def bye(self, word: bytes = b"bye") -> None:
        """This process ends on purpose: its socket's close is no death. ``b"fail"``: it ends the launch (the keeper
        tells the others at once to fall back rather than wait for a spare)."""
        self._quiet.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.sendall(word + b"\n")
                self._sock.close()
            self._sock = None

    def read(self, key: str) -> dict | None:
        """The sealed value under ``key`` now (never waiting: a stranger may delete a key between a check and a
        get), None when there is none or it is not the launch's."""
        value = self.seal.open(key, peek(self.store, key))
        return None if value is None else json.loads(value)

    def wait(self, key: str, timeout_s: float) -> dict | None:
        """The sealed value under ``key`` once there, blocking in the store (no polling); None after ``timeout_s``.
        A value not the launch's is waited past, after a short pause (a stranger can make this poll, no faster)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.store.wait([key], timedelta(seconds=left))
            except dist.DistError:  # not there in time (or the store gone: the caller's next call says)
                return None
            value = self.read(key)
            if value is not None:
                return value
            time.sleep(0.05)
        return None

    def plan(self, gen: int, timeout_s: float) -> dict | None:
        return self.wait(plan_key(gen), timeout_s)

    def assignment(self, spare: int) -> dict:
        """Block until the keeper gives this spare a place (or tells it to close; also when the keeper is gone)."""
        while True:
            value = self.read(assign_key(spare))
            if value is not None:
                return value
            if self.notice(timeout_s=5.0) == "gone":
                return {"close": True}

    def notice(self, wake: int | None = None, timeout_s: float | None = None) -> str:
        """Block on the keeper's socket until it says there is news in the store ("look": a plan, a place, a close),
        it closes ("gone"), ``wake`` (a pipe's read end) is readable ("woken"), or ``timeout_s`` ("timeout"). No
        timed waits in the store: each one that times out is a warning line in the process's output."""
        sock = self._sock
        if sock is None:
            return "gone"
        try:
            readable, _, _ = select.select([sock, *([] if wake is None else [wake])], [], [], timeout_s)
            if wake is not None and wake in readable:
                return "woken"
            if not readable:
                return "timeout"
            return "look" if sock.recv(256) else "gone"
        except (OSError, ValueError):  # closed meanwhile (the process ends)
            return "gone"

    def meet(self, rank: int, world: int, place: dict, layout_of: Callable[[list[dict]], dict],
             timeout_s: float) -> dict:  # fmt: skip
        """The launch's layout, met in the store: every rank leaves its ``place``; rank 0 reads them all and leaves
        ``layout_of(places)`` (or the UserError it raised, which every rank then raises)."""
        self.publish(where_key(rank), place)
        deadline = time.monotonic() + timeout_s
        if rank == 0:
            places = []
            for other in range(world):
                value = self.wait(where_key(other), max(0.1, deadline - time.monotonic()))
                if value is None:
                    self.publish(LAYOUT_KEY, {"error": f"rank {other} did not reach the launch's keeper at "
                                              f"{self.where.addr}:{self.where.store_port} within {timeout_s:g} s "
                                              "(comm.timeout_s)"})  # fmt: skip
                    break
                places.append(value)
            else:
                try:
                    self.publish(LAYOUT_KEY, layout_of(places))
                except UserError as exc:
                    self.publish(LAYOUT_KEY, {"error": str(exc)})
        layout = self.wait(LAYOUT_KEY, max(0.1, deadline - time.monotonic()))
        if layout is None:
            raise UserError(f"rank {rank}: rank 0 left no layout in the launch's keeper's store within "
                            f"{timeout_s:g} s (comm.timeout_s)")  # fmt: skip
        if "error" in layout:
            raise UserError(layout["error"], collective=True)
        return layout

    def publish(self, key: str, value: dict) -> None:
        """A value for the spares (sealed as the keeper's own: only this launch's processes hold the key)."""
        seal = Seal(self._secret, KEEPER_RANK)
        self.store.set(key, seal.seal(key, json.dumps(value, sort_keys=True)))


def _line(sock: socket.socket) -> str:
    """The keeper's first line (a notice may follow it at once: dropped, each watch looks in the store first)."""
    data = b""
    while b"\n" not in data and len(data) < 512:
        chunk = sock.recv(512)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n")[0].decode("ascii", "replace").strip()


class PlanWatch:
    """A daemon thread that waits for the keeper's plan for generation ``gen + 1``; when it comes, cuts this
    process's accepted TCP connections (gloo's pairs: every pair has one accepting end, so every survivor's cut
    fails every blocked collective) and keeps the plan for the main thread. It blocks on the keeper's socket, which
    says when to look in the store (``KeeperLink.notice``)."""

    def __init__(self, link: KeeperLink, gen: int) -> None:
        self.link, self.next = link, gen + 1
        self.plan: dict | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="hpc-plan-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        key = plan_key(self.next)
        while True:
            try:
                plan = self.link.read(key)  # first: a plan may have come before this watch began
            except Exception:  # the store gone: the launch is ending
                return
            if plan is not None:  # a spare planned in, or the fall-back: either way this generation is over
                self.plan = plan
                # A lost node's connections never close: the ones to its address go too (the keeper's stay).
                mine, keeper = self.link.local_addr, self.link.keeper_addr
                away = {a for a in plan.get("addrs", {}).values() if a and a != mine}
                cut = cut_connections(away, {(keeper, self.link.where.store_port), (keeper, self.link.where.live_port)})
                log.info("generation %d planned: %d gloo connection(s) cut", self.next, cut)
                return
            if self.link.notice(wake=self._wake_r) != "look":  # closed, or the keeper gone
                return

    def close(self) -> None:
        """Stopped and joined: a cut must not reach the next generation's connections."""
        os.write(self._wake_w, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)


def cut_connections(away: set[str], keep: set[tuple[str, int]]) -> int:
    """Shut down every TCP connection this process accepted (the ones on a port it listens on), and every one to an
    address in ``away`` but those to ``keep`` (address, port); how many."""
    table = _tcp_table()
    listening = {row[0] for row in table.values() if row[1] == "0A"}

    def chosen(row: tuple) -> bool:
        return row[1] == "01" and (row[0] in listening or (row[2][0] in away and row[2] not in keep))  # ESTABLISHED

    mine: dict[int, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                mine[int(fd)] = int(link[8:-1])
    cut = 0
    for fd, inode in mine.items():
        if inode in table and chosen(table[inode]):
            with contextlib.suppress(OSError):
                sock = socket.socket(fileno=os.dup(fd))
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
                cut += 1
    return cut


def _tcp_table() -> dict[int, tuple[int, str, tuple[str, int]]]:
    """{socket inode: (local port, state, (remote address, remote port))} from /proc/self/net/tcp and tcp6."""
    out: dict[int, tuple[int, str, tuple[str, int]]] = {}
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/self/net/{name}").read_text().splitlines()[1:]:
                f = line.split()
                remote, rport = f[2].rsplit(":", 1)
                out[int(f[9])] = (int(f[1].rsplit(":", 1)[1], 16), f[3], (_address(remote), int(rport, 16)))
    return out


def _address(hexed: str) -> str:
    """/proc/net/tcp's address (words in the host's byte order) as text; an IPv4-mapped IPv6 one as IPv4."""
    raw = b"".join(struct.pack("=I", int(hexed[i : i + 8], 16)) for i in range(0, len(hexed), 8))
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntop(socket.AF_INET, raw[12:])
    return socket.inet_ntop(socket.AF_INET6, raw)


def end_groups() -> None:
    """The broken generation's process groups gone, so that the next can be made in this process (no abort first:
    gloo's does nothing, and the connections are already cut)."""
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
