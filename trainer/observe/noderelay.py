"""A node's ranks share their leader's store connections: the node's first rank (the hub) takes its members'
heartbeats and answers over a Unix socket and relays roll calls, claims and the store's health back to them.

At 4,096 ranks, two watchdog connections and two keys a rank cost rank 0's store about 3 KB a rank and a heartbeat
write a rank each interval; relayed, they cost that a node. The socket lies in a folder that only this user can
enter, named from the launch's secret (no one else can guess it to take it first), and each end checks that the
other runs as this user (SO_PEERCRED). Messages are JSON lines."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path

from storage.private import private_dir

SEND_TIMEOUT_S = 1.0  # a member that does not read its socket (frozen) is skipped, not waited for
PREFIX = "hpc-relay-"
STALE_S = 60.0  # a relay folder this old with no hub listening in it is a killed launch's


def sweep(root: Path | None = None, *, older_s: float = STALE_S) -> list[Path]:
    """Remove this user's relay folders that a killed launch left (its hubs ended without closing: os._exit, SIGKILL):
    older than ``older_s`` and with no socket that takes a connection. Another live launch's folder is kept."""
    root = root if root is not None else Path(tempfile.gettempdir())
    removed, now = [], time.time()
    for folder in root.glob(f"{PREFIX}*"):
        try:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or now - st.st_mtime < older_s:
                continue
            socks = list(folder.iterdir())
            if any(_listening(s) for s in socks):
                continue
            for s in socks:
                s.unlink()
            folder.rmdir()
            removed.append(folder)
        except OSError:  # another rank of the host swept it first, or it is in use after all
            continue
    return removed


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
            return True
        except OSError:
            return False


def relay_path(token: str, node: int) -> Path:
    """Where node ``node``'s hub listens: node-local ($TMPDIR, else /tmp), one folder a launch."""
    return Path(tempfile.gettempdir()) / f"{PREFIX}{token}" / f"n{node}.sock"


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _line(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


class Hub:
    """The leader's end: each member says its rank, then sends its heartbeats, roll-call answers and stack-dump
    acknowledgements; the hub keeps the latest of each and sends the members what the leader relays."""

    def __init__(self, path: Path, members: list[int]) -> None:
        self.path, self.members = path, set(members)
        self.beats: dict[int, dict] = {}  # each member's latest heartbeat (kept when it goes: its last sign)
        self.answers: set[int] = set()
        self.dumped: set[int] = set()
        self._conns: dict[int, socket.socket] = {}
        self._cond = threading.Condition()
        self._send = threading.Lock()
        self._sel = selectors.DefaultSelector()
        private_dir(path.parent, what="the node's relay folder")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # this launch's own (an in-job restart on the same node)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(len(members) + 8)
        self._server.setblocking(False)
        self._sel.register(self._server, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="hpc-node-hub", daemon=True)
        self._thread.start()

    # -- the hub's thread -------------------------------------------------------------------------------------
    def _serve(self) -> None:
        pending: dict[socket.socket, bytes] = {}
        ranks: dict[socket.socket, int] = {}
        while not self._closed:
            for key, _ in self._sel.select(timeout=1.0):
                sock = key.fileobj
                if sock is self._wake_r:
                    continue
                if sock is self._server:
                    self._accept(pending)
                    continue
                try:
                    data = sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._drop(sock, pending, ranks)
                    continue
                lines = (pending[sock] + data).split(b"\n")
                pending[sock] = lines.pop()
                for line in lines:
                    if not self._take(sock, line, ranks):
                        self._drop(sock, pending, ranks)
                        break

    def _accept(self, pending: dict[socket.socket, bytes]) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            conn, _ = self._server.accept()
            if peer_uid(conn) != os.getuid():  # the folder keeps others out; this says so twice
                conn.close()
                return
            conn.setblocking(False)
            pending[conn] = b""
            self._sel.register(conn, selectors.EVENT_READ)

    def _take(self, sock: socket.socket, line: bytes, ranks: dict[socket.socket, int]) -> bool:
        """One message from a member; False for one that breaks the protocol (the connection is dropped)."""
        try:
            message = json.loads(line)
        except ValueError:
            return False
        if not isinstance(message, dict):
            return False
        if sock not in ranks:  # the first message names the member
            rank = message.get("rank")
            if rank not in self.members:
                return False
            ranks[sock] = rank
            with self._cond:
                old = self._conns.get(rank)
                self._conns[rank] = sock
            if old is not None and old is not sock:
                with contextlib.suppress(OSError):
                    old.close()
            return True
        rank = ranks[sock]
        with self._cond:
            if "beat" in message:
                self.beats[rank] = message["beat"]
            if "answer" in message:
                self.answers.add(rank)
            if "dumped" in message:
                self.dumped.add(rank)
            self._cond.notify_all()
        return True

    def _drop(self, sock: socket.socket, pending: dict, ranks: dict) -> None:
        with contextlib.suppress(Exception):
            self._sel.unregister(sock)
        pending.pop(sock, None)
        rank = ranks.pop(sock, None)
        with self._cond:
            if rank is not None and self._conns.get(rank) is sock:
                del self._conns[rank]
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            sock.close()

    # -- the leader's threads ---------------------------------------------------------------------------------
    def connected(self) -> set[int]:
        with self._cond:
            return set(self._conns)

    def snapshot(self) -> dict[int, dict]:
        with self._cond:
            return dict(self.beats)

    def send_all(self, message: dict) -> None:
        """``message`` to every connected member; one whose socket does not take it within SEND_TIMEOUT_S is
        skipped (a frozen member's buffer is full)."""
        line = _line(message)
        with self._cond:
            conns = list(self._conns.values())
        with self._send:  # the leader's threads send in turn: lines never interleave
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.settimeout(SEND_TIMEOUT_S)  # blocking with a bound, while the hub's thread reads it too
                    conn.sendall(line)
                    conn.setblocking(False)

    def roll_call(self, window_s: float) -> set[int]:
        """The members that answer a roll call within ``window_s``."""
        with self._cond:
            self.answers.clear()
        self.send_all({"call": 1})
        return self._wait(self.answers, window_s)

    def wait_dumped(self, window_s: float, skip: set[int]) -> set[int]:
        """The members that acknowledged a claim (their stacks dumped) within ``window_s``; ``skip``: the claiming
        rank, which writes the report instead."""
        return self._wait(self.dumped, window_s, skip)

    def wait_finished(self, window_s: float) -> None:
        """Until every connected member's latest heartbeat says it finished (its last one), or ``window_s``."""
        deadline = time.monotonic() + window_s
        with self._cond:
            while time.monotonic() < deadline and any(
                self.beats.get(r, {}).get("phase") != "finished" for r in self._conns
            ):
                self._cond.wait(max(0.0, deadline - time.monotonic()))

    def _wait(self, done: set[int], window_s: float, skip: set[int] = frozenset()) -> set[int]:
        deadline = time.monotonic() + window_s
        with self._cond:
            while time.monotonic() < deadline and not set(self._conns) - skip <= done:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            return set(done)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        with self._cond:
            conns, self._conns = list(self._conns.values()), {}
        for sock in [*conns, self._server, self._wake_r, self._wake_w]:
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # the last of the host's leaders removes the folder


class Spoke:
    """A member's end: connects to its node's hub (waiting up to ``timeout_s`` for it to listen), then sends
    messages and reads the relayed ones."""

    def __init__(self, path: Path, rank: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            except OSError:
                sock.close()
                raise
        if peer_uid(sock) != os.getuid():
            sock.close()
            raise PermissionError(f"{path}: the node's hub does not run as user {os.getuid()}")
        self._sock, self._buf, self._lock = sock, b"", threading.Lock()
        if not self.send({"rank": rank}):
            raise ConnectionError(f"{path}: the node's hub closed the connection")

    def send(self, message: dict) -> bool:
        with self._lock:
            try:
                self._sock.sendall(_line(message))
                return True
            except OSError:
                return False

    def recv(self, timeout_s: float) -> dict | None:
        """The next message; None once the hub is gone; TimeoutError when none came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            try:
                self._sock.settimeout(left)
                data = self._sock.recv(65536)
            except TimeoutError:
                raise
            except OSError:
                return None
            if not data:
                return None
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def close(self) -> None:
        """Ends the connection; a thread blocked in ``recv`` returns None."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
