"""Reading the rendezvous store without waiting: the ranks' heartbeats (sealed by trainer/parallel/storeseal.py)
for the watchdog and the live endpoints, and whether anything still listens on the store's port at all."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

import torch.distributed as dist

from trainer.parallel.storeseal import Seal

# compare_set's answer for a key that is not there: a read that never waits (a get waits for a missing key, and
# someone else may delete one between a check and a get)
MISSING = "\0hpc-missing"
READ_CHUNK = 256  # keys a multi-key read asks for at once: a missing one costs a round trip for each of its chunk
MULTI_GET_WAIT_S = 1.0  # a multi-key read waits for missing keys: the most it may wait for one deleted meanwhile


def listening(addr: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts connections on ``addr:port`` within ``timeout_s``. A refused connection answers at
    once (the store's process is gone, its host up), where a TCPStore client retries until its own timeout."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def read_beats(
    store: dist.TCPStore, key: Callable[[int], str], ranks: Iterable[int], seal: Seal, absent: set[int] | None = None
) -> dict[int, dict]:
    """The latest heartbeat of each of ``ranks`` that has published one (values this launch did not write left out,
    counted by ``seal``); ``absent`` collects the ranks whose key holds nothing."""
    ranks = list(ranks)
    now, raw = time.time(), dict(zip(ranks, read_all(store, [key(r) for r in ranks]), strict=True))
    (absent if absent is not None else set()).update(r for r, v in raw.items() if v is None)
    beats = {r: json_of(seal.open(key(r), v, now=now)) for r, v in raw.items()}
    return {r: b for r, b in beats.items() if b is not None}


def read_all(store: dist.TCPStore, keys: list[str]) -> list[bytes | None]:
    """Each key's value now (None where there is none), READ_CHUNK keys at a time: two round trips for a chunk whose
    keys are all there, else one per key of that chunk. Rank 0 reads every rank's heartbeat each interval, and a roll
    call every rank's answer: one round trip per key cost 13% of a core and 15 s at 4,096 ranks. A key that someone
    else deletes between the check and the read costs at most MULTI_GET_WAIT_S, then the chunk's reads one by one."""
    out: list[bytes | None] = []
    for i in range(0, len(keys), READ_CHUNK):
        chunk = keys[i : i + READ_CHUNK]
        out += _read_chunk(store, chunk)
    return out


def _read_chunk(store: dist.TCPStore, keys: list[str]) -> list[bytes | None]:
    if len(keys) > 1 and store.check(keys):
        before = store.timeout
        store.set_timeout(timedelta(seconds=MULTI_GET_WAIT_S))
        try:
            return list(store.multi_get(keys))
        except dist.DistStoreError:
            pass
        finally:
            store.set_timeout(before)
    return [peek(store, key) for key in keys]


def peek(store: dist.TCPStore, key: str) -> bytes | None:
    """The value under ``key`` now, None if there is none, without waiting."""
    value = store.compare_set(key, MISSING, MISSING)
    return None if value == MISSING.encode() else value


def json_of(value: str | None) -> dict | None:
    """A heartbeat's or claim's fields; None for none (a sealed value is the launch's own, so well formed)."""
    return json.loads(value) if value is not None else None


class BeatReader:
    """The latest heartbeat of given ranks, read from the rendezvous store on a connection opened at first use (and
    again after a failure). Safe for several threads (a lock); an unreachable store reads as no beats."""

    def __init__(
        self, connect: Callable[[], dist.TCPStore], read: Callable[[dist.TCPStore, list[int]], dict[int, dict]]
    ) -> None:
        self._connect, self._read = connect, read
        self._store: dist.TCPStore | None = None
        self._lock = threading.Lock()

    def read(self, ranks: Iterable[int]) -> dict[int, dict]:
        with self._lock:
            try:
                if self._store is None:
                    self._store = self._connect()
                return self._read(self._store, list(ranks))
            except Exception:
                self._store = None
                return {}


class BeatTable:
    """The last heartbeat of every rank, as rank 0's watchdog keeps it between reads: in arrays, 34 bytes a rank
    (a dict a rank took about 350, and parsing them all at once 900 more at the peak). Reads like a dict of beats
    (``in``, ``[]``, ``[] =``, ``items``), each beat made when asked for."""

    def __init__(self, world_size: int) -> None:
        self.beat = array("d", [math.nan]) * world_size  # NaN: none yet
        self.since = array("d", [0.0]) * world_size
        self.seq = array("q", [0]) * world_size
        self.step = array("q", [0]) * world_size
        self.phase = array("H", [0]) * world_size  # an index into _phases (the trainer's dozen phase names)
        self._phases: list[str] = [""]
        self._index: dict[str, int] = {"": 0}

    def put(self, rank: int, beat: dict) -> None:
        phase = str(beat["phase"])
        index = self._index.get(phase)
        if index is None:
            index = len(self._phases) if len(self._phases) < 65535 else 0
            if index:
                self._phases.append(phase)
                self._index[phase] = index
        self.beat[rank], self.since[rank] = float(beat["beat"]), float(beat["since"])
        self.seq[rank], self.step[rank], self.phase[rank] = int(beat["seq"]), int(beat["step"]), index

    __setitem__ = put

    def finished(self, rank: int) -> bool:
        return self._phases[self.phase[rank]] == "finished"

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and 0 <= rank < len(self.beat) and not math.isnan(self.beat[rank])

    def __getitem__(self, rank: int) -> dict:
        if rank not in self:
            raise KeyError(rank)
        return {"seq": self.seq[rank], "phase": self._phases[self.phase[rank]], "step": self.step[rank],
                "since": self.since[rank], "beat": self.beat[rank]}  # fmt: skip

    def old(self, rank: int, before: float) -> bool:
        """No beat of this rank, or one from before ``before`` that is not its last (finished)."""
        return rank not in self or (self.beat[rank] < before and not self.finished(rank))

    def items(self) -> Iterator[tuple[int, dict]]:
        return ((r, self[r]) for r in range(len(self.beat)) if r in self)
