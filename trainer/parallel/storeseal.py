"""Values in the rendezvous store that only this launch's ranks can have written.

The store is open to anyone who reaches its port (torch binds every interface and lists every key), so each value
the package writes there is sealed: an HMAC-SHA256 over the key, the value, the writer's rank and a counter, with a
per-launch secret that rank 0 makes and MPI hands to the others (it never touches a file or the store). A reader
opens a value only when its seal holds and it is newer than the last one it opened under that key; anything else
(forged, replayed, garbage) reads as nothing and is counted, never as an error."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import secrets
import threading

SECRET_BYTES = 32
log = logging.getLogger(__name__)


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


class Seal:
    """Seals and opens this launch's store values; counts the values it refused (``rejected``)."""

    def __init__(self, secret: bytes, rank: int) -> None:
        self._secret, self._rank = secret, rank
        self._counter = itertools.count(1)
        self._seen: dict[tuple[str, int], int] = {}  # (key, writer) -> newest counter opened
        self._lock = threading.Lock()
        self.rejected = {"forged": 0, "stale": 0, "garbage": 0, "deleted": 0}
        self.contested: dict[str, float] = {}  # key -> when a refused value was last found there

    def _mac(self, key: str, value: str, rank: int, n: int) -> str:
        text = json.dumps([key, value, rank, n], separators=(",", ":"))
        return hmac.new(self._secret, text.encode(), hashlib.sha256).hexdigest()

    def token(self, label: str) -> str:
        """A name derived from the launch's secret (the same on every rank; no one else can guess it)."""
        return hmac.new(self._secret, label.encode(), hashlib.sha256).hexdigest()[:20]

    def seal(self, key: str, value: str) -> str:
        n = next(self._counter)
        return json.dumps({"v": value, "r": self._rank, "n": n, "m": self._mac(key, value, self._rank, n)})

    def open(self, key: str, raw: bytes | str | None, *, now: float = 0.0) -> str | None:
        """The value sealed under ``key``, or None (refused, counted) when it is not this launch's or not new. The
        same value opened again is not new but is not refused either: it is returned (a reader polls)."""
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            value, rank, n, mac = data["v"], int(data["r"]), int(data["n"]), str(data["m"])
            if not isinstance(value, str):
                raise TypeError
        except (ValueError, TypeError, KeyError):
            return self._refuse(key, "garbage", now)
        if not hmac.compare_digest(mac, self._mac(key, value, rank, n)):
            return self._refuse(key, "forged", now)
        with self._lock:
            newest = self._seen.get((key, rank), 0)
            if n >= newest:
                self._seen[(key, rank)] = n
        return value if n >= newest else self._refuse(key, "stale", now)

    def _refuse(self, key: str, why: str, now: float) -> None:
        with self._lock:
            self.rejected[why] += 1
            self.contested[key] = now
            total = sum(self.rejected.values())
        if total in (1, 10, 100) or total % 1000 == 0:
            log.warning("rendezvous store: %d value(s) not written by this launch ignored so far (%s); the last "
                        "under %s: someone else is writing to the store", total, self.counts(), key)  # fmt: skip
        return None

    def note_deleted(self, key: str, now: float) -> None:
        """A key that held this launch's value is gone: someone else deleted it (the package never does)."""
        self._refuse(key, "deleted", now)

    def counts(self) -> str:
        with self._lock:
            return ", ".join(f"{n} {why}" for why, n in self.rejected.items() if n) or "none"

    def recently_contested(self, key: str, since: float) -> bool:
        with self._lock:
            return self.contested.get(key, float("-inf")) >= since
