"""The kernel's record of process exits, in order and timestamped: the netlink process-events connector
(``linux/cn_proc.h``), torch-free.

A watcher that wakes on a process's end (a pidfd) can only order what it saw in separate wake-ups; when one rank's
death makes the launcher kill the others within milliseconds and the host is busy, it wakes once to find all of
them ended. The connector's events carry the moment each process exited (CLOCK_MONOTONIC, as ``time.monotonic``)
and queue in the socket until read, so a late reader still gets the order. The kernel sends them to listeners in
the initial pid namespace (any user since Linux 6.6, before that only with CAP_NET_ADMIN); in a container's pid
namespace ``ProcExits.open`` returns None, and where no event comes for a rank its caller falls back to the order it
saw.
"""

from __future__ import annotations

import contextlib
import socket
import struct

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_EVENT_EXIT = 0x80000000
NLMSG_DONE = 3
SO_RCVBUFFORCE = 33
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # id.idx, id.val, seq, ack, len, flags
_EVENT = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_EXIT = struct.Struct("=iiII")  # process_pid, process_tgid, exit_code, exit_signal


def _in_initial_pid_namespace() -> bool:
    """The connector reports pids as the initial namespace sees them: ours must be the same."""
    try:
        for line in open("/proc/self/status"):  # noqa: SIM115 (read once)
            if line.startswith("NSpid:"):
                return len(line.split()) == 2
    except OSError:
        return False
    return True  # kernels before 4.1 have no NSpid line: no namespaces to tell apart


class ProcExits:
    """Every process exit on the host after ``open``: ``exited(pid, after)`` gives (monotonic seconds, wait status).
    ``lossless`` turns False if the socket ever overflowed (events lost: the caller must not trust an absence)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lossless = True
        self._exits: dict[int, list[tuple[float, int]]] = {}

    @classmethod
    def open(cls) -> ProcExits | None:
        if not hasattr(socket, "AF_NETLINK") or not _in_initial_pid_namespace():
            return None
        sock = None
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
            with contextlib.suppress(OSError):  # a bigger queue where allowed: a busy host exits many processes
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 4 << 20)
            sock.bind((0, CN_IDX_PROC))
            op = struct.pack("=I", PROC_CN_MCAST_LISTEN)
            cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(op), 0) + op
            sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(cn), NLMSG_DONE, 0, 0, 0) + cn)
            sock.setblocking(False)
        except OSError:
            if sock is not None:
                sock.close()
            return None
        return cls(sock)

    def drain(self, only: set[int] | None = None) -> None:
        """Read what the kernel queued (non-blocking); with ``only``, keep the exits of those pids alone (the
        others are dropped: a long run on a busy host sees many)."""
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError:  # ENOBUFS: the queue overflowed, events were dropped
                self.lossless = False
                continue
            self._parse(data, only)

    def _parse(self, data: bytes, only: set[int] | None) -> None:
        offset = 0
        while offset + _NLMSGHDR.size <= len(data):
            length = _NLMSGHDR.unpack_from(data, offset)[0]
            event = offset + _NLMSGHDR.size + _CN_MSG.size
            if length < _NLMSGHDR.size or event + _EVENT.size + _EXIT.size > len(data):
                return
            what, _cpu, ts_ns = _EVENT.unpack_from(data, event)
            if what == PROC_EVENT_EXIT:
                pid, tgid, status, _ = _EXIT.unpack_from(data, event + _EVENT.size)
                if pid == tgid and (only is None or tgid in only):  # the process, not one of its threads
                    self._exits.setdefault(tgid, []).append((ts_ns / 1e9, status))
            offset += (length + 3) & ~3

    def exited(self, pid: int, after: float) -> tuple[float, int] | None:
        """The first exit of ``pid`` after monotonic time ``after`` (a pid is reused once its process is gone)."""
        return next((e for e in self._exits.get(pid, ()) if e[0] > after), None)

    def close(self) -> None:
        self.sock.close()
