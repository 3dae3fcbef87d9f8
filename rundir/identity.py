"""A run's identity, made once with its run directory (``identity.json``, 0600, torch-free): ``run_id`` names the run
in its checkpoints' manifests and in the owner record of its ``checkpoint.storage`` prefix; ``key`` authenticates
its manifests (an HMAC), so that a generation someone else wrote into the bucket is never unpickled. Only the run
directory holds the key; a copied config carries neither."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

RUN_MAC = "run_mac"  # the manifest's HMAC, over everything but itself and its self-checksum


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    key: bytes = b""

    def short(self) -> str:
        return self.run_id[:12]


def ensure_identity(path: Path) -> RunIdentity:
    """The identity in ``path``, made there (exclusively, not following a link) if there is none yet."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return read_identity(path)
    identity = RunIdentity(secrets.token_hex(16), secrets.token_bytes(32))
    with os.fdopen(fd, "w") as f:
        json.dump({"run_id": identity.run_id, "key": identity.key.hex()}, f)
        f.flush()
        os.fsync(f.fileno())
    return identity


def read_identity(path: Path) -> RunIdentity:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        data = json.load(f)
    return RunIdentity(str(data["run_id"]), bytes.fromhex(data["key"]))


def _mac(body: dict, key: bytes) -> str:
    text = json.dumps({k: v for k, v in body.items() if k not in (RUN_MAC, "manifest_sha256")}, sort_keys=True)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def seal_manifest(body: dict, identity: RunIdentity) -> dict:
    """A generation's manifest body named as this run's and authenticated with its key."""
    body = {**body, "run_id": identity.run_id}
    return {**body, RUN_MAC: _mac(body, identity.key)}


def manifest_problem(manifest: dict, identity: RunIdentity) -> tuple[str, str] | None:
    """("other", message) when the manifest names another run, ("unsealed", message) when this run's key does not
    authenticate it (written by someone else, or before runs had keys), or None."""
    named = manifest.get("run_id")
    if named is not None and named != identity.run_id:
        return "other", f"its manifest names another run (run id {str(named)[:12]})"
    mac = manifest.get(RUN_MAC)
    if named is None or not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(manifest, identity.key)):
        return "unsealed", "its manifest is not authenticated by this run's key (never unpickled)"
    return None
