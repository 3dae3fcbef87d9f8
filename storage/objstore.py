"""Object storage through fsspec (s3fs for s3://): open a URL with the config's endpoint, retry what passes, and
turn what does not into one paragraph naming the URL and the config key (torch-free).

Credentials are never handled here: s3fs (botocore) finds them in the environment (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), a profile (AWS_PROFILE, storage.profile) or the instance role.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from runconfig.schema.storage import StorageConfig
from storage.ioretry import RetryPolicy, is_transient, retry

T = TypeVar("T")
log = logging.getLogger(__name__)
# ``download_hashed``: an object is read in ranges of RANGE_BYTES, RANGES_AT_ONCE of them requested at a time (memory:
# those, one more waiting its turn, and the one being hashed and written, per download).
RANGE_BYTES = 16 << 20
RANGES_AT_ONCE = 2
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# Messages of S3 errors that pass (throttling, a server restarting or failing over).
_TRANSIENT_TEXT = re.compile(
    r"ServiceUnavailable|SlowDown|InternalError|RequestTimeout|Throttl|503|502|500 |Connection reset|"
    r"Server disconnected|Connection closed|timed out",
    re.I,
)


def is_url(path: str | os.PathLike) -> bool:
    """A remote URL (s3://, gs://, ...): not a plain path and not file://."""
    m = _URL.match(str(path))
    return bool(m) and m.group(1).lower() != "file"


def local_path(path: str) -> str:
    """A plain path for a plain path or a file:// URL."""
    return path[len("file://") :] if str(path).startswith("file://") else str(path)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


class StoreUnavailable(OSError):
    """A request to the store failed in a way that passes (the endpoint unreachable, a reset, a 5xx, throttling):
    a transient OSError (ECONNRESET), retried, then a crash that the in-job restart handles."""


class StoreError(Exception):
    """A request that repeating cannot fix (missing object or bucket, denied access, no credentials): the message
    is one paragraph naming the URL and what it was for."""


@dataclass(frozen=True)
class Store:
    """fsspec filesystems for the URLs of one run, opened with ``cfg``'s endpoint, region and profile; each Store
    opens its own (credentials are read when one is made, so a new Store sees changed ones)."""

    cfg: StorageConfig
    _opened: dict = field(default_factory=dict, compare=False, repr=False)

    def endpoint(self, url: str) -> str:
        if not url.startswith("s3://"):
            return _URL.match(url).group(1) + " default" if is_url(url) else "local"
        return self.cfg.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3 (no endpoint_url set)"

    def fs(self, url: str) -> tuple[Any, str]:
        """(filesystem, path in it) for ``url``; a plain path gives the local filesystem."""
        import fsspec.core

        protocol = _URL.match(url).group(1) if is_url(url) else "file"
        with _LOCK:
            fs = self._opened.get(protocol)
            if fs is None:  # made once per protocol: the options are the same for every URL of it
                fs = self._opened[protocol] = fsspec.core.url_to_fs(
                    url, skip_instance_cache=True, **self._options(url)
                )[0]
        return fs, fs._strip_protocol(url)

    def _options(self, url: str) -> dict[str, Any]:
        if not url.startswith("s3://"):
            return {}
        client: dict[str, Any] = {}
        if self.cfg.endpoint_url:
            client["endpoint_url"] = self.cfg.endpoint_url
        if self.cfg.region:
            client["region_name"] = self.cfg.region
        options: dict[str, Any] = {
            "client_kwargs": client,
            "use_listings_cache": False,  # generations and shards appear while a run reads the prefix
            "config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}},
        }
        if self.cfg.profile:
            options["profile"] = self.cfg.profile
        return options

    def policy(self) -> RetryPolicy:
        return RetryPolicy(self.cfg.retries, self.cfg.retry_backoff_s, "storage.retries")

    def call(self, fn: Callable[[Any, str], T], url: str, *, what: str, key: str = "") -> T:
        """``fn(fs, path)`` for ``url``, retried while the store fails transiently. Raises StoreUnavailable when
        the retries are exhausted, StoreError (one paragraph) for what retrying cannot fix."""
        fs, path = self.fs(url)

        def attempt() -> T:
            try:
                return fn(fs, path)
            except Exception as exc:
                raise self.classify(exc, url, what=what, key=key) from exc

        return retry(attempt, self.policy(), what=what, path=url, log=log)

    def classify(self, exc: BaseException, url: str, *, what: str, key: str = "") -> BaseException:
        """The exception to raise for ``exc``: StoreUnavailable (transient), StoreError (not), or ``exc`` itself
        (a local OSError that is not a store's: ENOSPC on the cache disk, say)."""
        at = f" ({key})" if key else ""
        endpoint = self.endpoint(url)
        if isinstance(exc, StoreUnavailable | StoreError):
            return exc
        name = type(exc).__name__
        text = " ".join(str(exc).split())[:300]
        if name == "NoCredentialsError":
            return StoreError(
                f"{what} {url}{at}: no credentials were found for {endpoint}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or storage.profile) in the environment that submits the job, "
                "or run where an instance role provides them; credentials never go in the config."
            )
        if isinstance(exc, FileNotFoundError):
            bucket = url.split("://", 1)[-1].split("/", 1)[0]
            if "bucket" in text.lower():
                return StoreError(f"{what} {url}{at}: bucket {bucket!r} does not exist at {endpoint}.")
            return StoreError(f"{what} {url}{at}: no such object at {endpoint}.")
        if isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
            return StoreError(
                f"{what} {url}{at}: access denied by {endpoint} ({text}): the credentials in the environment "
                "(AWS_ACCESS_KEY_ID, AWS_PROFILE or the instance role) are wrong, or lack permission on this bucket."
            )
        if name in ("InvalidAccessKeyId", "SignatureDoesNotMatch") or "InvalidAccessKeyId" in text:
            return StoreError(f"{what} {url}{at}: {endpoint} refused the credentials ({text}).")
        if _is_transient(exc) or _TRANSIENT_TEXT.search(text):
            return StoreUnavailable(errno.ECONNRESET, f"{endpoint} unavailable ({name}: {text})", url)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            return exc  # local: the cache disk's, named by its caller
        return StoreError(f"{what} {url}{at} failed at {endpoint}: {name}: {text}.")

    # The operations the trainer uses, each retried and classified.
    def read_bytes(self, url: str, *, what: str, key: str = "") -> bytes:
        return self.call(lambda fs, p: fs.cat_file(p), url, what=what, key=key)

    def write_bytes(self, url: str, data: bytes, *, what: str, key: str = "") -> None:
        self.call(lambda fs, p: fs.pipe_file(p, data), url, what=what, key=key)

    def sizes(self, url: str, *, what: str, key: str = "") -> dict[str, int]:
        """{name: bytes} of the objects directly under the prefix ``url`` (one listing)."""

        def listing(fs, p):
            return {e["name"].rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in fs.ls(p, detail=True)}

        return self.call(listing, url, what=what, key=key)

    def download(self, url: str, dest: str, *, what: str, key: str = "") -> None:
        self.call(lambda fs, p: fs.get_file(p, dest), url, what=what, key=key)

    def download_hashed(self, url: str, dest: str, size: int, *, what: str, key: str = "") -> str:
        """Download the first ``size`` bytes of the object at ``url`` (what its manifest records) into ``dest``;
        returns the SHA-256 of the bytes written, for the caller to check against the manifest's. Ranges are
        requested several at a time, then hashed and written in order as they arrive: the hash needs no second read
        and overlaps the transfer. Each range is retried on its own. An object shorter than ``size`` is a
        StoreError; bytes past ``size`` are not read (the copy is the manifest's, or fails its hash)."""
        digest = hashlib.sha256()

        def get(start: int, end: int) -> bytes:
            if start == end:  # an empty file: only that the object exists
                self.call(lambda fs, p: fs.info(p), url, what=what, key=key)
                return b""
            data = self.call(lambda fs, p: fs.cat_file(p, start=start, end=end), url, what=what, key=key)
            if len(data) != end - start:
                raise StoreError(f"{what} {url}: the object is shorter than the {size} bytes expected: it changed or "
                                 "was damaged after it was written.")  # fmt: skip
            return data

        def append(future: Future) -> None:
            data = future.result()
            digest.update(data)
            f.write(data)

        ranges = [(start, min(start + RANGE_BYTES, size)) for start in range(0, size, RANGE_BYTES)] or [(0, 0)]
        pending: deque[Future] = deque()
        with open(dest, "wb") as f, ThreadPoolExecutor(RANGES_AT_ONCE, thread_name_prefix="range") as pool:
            try:
                for start, end in ranges:
                    pending.append(pool.submit(get, start, end))
                    if len(pending) > RANGES_AT_ONCE:  # the others are being fetched while this one is written
                        append(pending.popleft())
                while pending:
                    append(pending.popleft())
            finally:
                for future in pending:  # after an error: the ranges not started are not fetched
                    future.cancel()
        return digest.hexdigest()


_LOCK = threading.Lock()  # threads of one Store open its filesystems once


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and is_transient(exc):
        return True
    if isinstance(exc, TimeoutError | ConnectionError):
        return True
    kinds = {c.__name__ for c in type(exc).__mro__}
    return bool(
        kinds
        & {
            "EndpointConnectionError",
            "ConnectionClosedError",
            "ReadTimeoutError",
            "ConnectTimeoutError",
            "HTTPClientError",
            "ClientConnectorError",
            "ServerDisconnectedError",
            "ClientPayloadError",
            "ClientOSError",
            "IncompleteRead",
            "FSTimeoutError",
            "ResponseParserError",
        }
    )
