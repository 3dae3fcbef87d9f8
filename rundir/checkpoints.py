"""On-disk checkpoint generations under RUN_DIR/checkpoints (torch-free: the login node reads them too).

    checkpoints/
      step_00000120/          a committed generation: manifest.json exists and verifies
        manifest.json         written last, the commit marker; lists every file with size and SHA-256
        ...                   the files the trainer wrote
      .tmp-step_00000130/     being written (or left by a crash): never a checkpoint
      latest                  the name of the newest committed generation, moved only after a commit

A generation is valid when its manifest parses, its self-checksum matches (it was not edited), and every file
it lists exists with the recorded size and SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from storage.digest import sha256_file
from storage.files import fsync_path, write_json_atomic
from storage.ioretry import is_transient

MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
SET_ASIDE = ".invalid-"  # step_N.invalid-PID-NS: an invalid generation a new commit of its step replaced
STEP_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointInvalid(Exception):
    """A generation that must not be loaded; the message names the file at fault."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def generations(root: Path) -> list[tuple[int, Path]]:
    """Step directories (committed or not) sorted by step, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_RE.fullmatch(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def validate(path: Path, *, verify_hashes: bool = True) -> dict:
    """Return the manifest of a valid generation, or raise CheckpointInvalid naming what is wrong.

    A transient read error (EIO, ESTALE, ...: storage/ioretry.py) says nothing about the generation: it
    propagates as the OSError it is, for the caller to retry, and never makes a good generation look corrupt.
    """
    mpath = path / MANIFEST
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CheckpointInvalid(f"{mpath} is missing: the checkpoint was never committed") from None
    except (OSError, ValueError) as exc:
        if is_transient(exc):
            exc.filename = exc.filename or str(mpath)  # a failed read() names no file
            raise
        raise CheckpointInvalid(f"{mpath} cannot be read as JSON ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointInvalid(f"{mpath} has no file list")
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        raise CheckpointInvalid(f"{mpath} was modified after it was committed (its self-checksum does not match)")
    for rel, meta in sorted(manifest["files"].items()):
        fpath = path / rel
        try:
            size = fpath.stat().st_size
        except FileNotFoundError:
            raise CheckpointInvalid(f"{fpath} listed in the manifest is missing") from None
        if size != meta["size"]:
            raise CheckpointInvalid(f"{fpath} has {size} bytes, the manifest says {meta['size']} (truncated?)")
        if verify_hashes and _sha256_named(fpath) != meta["sha256"]:
            raise CheckpointInvalid(f"{fpath} does not match its SHA-256 in the manifest (corrupt)")
    return manifest


def _sha256_named(path: Path) -> str:
    try:
        return sha256_file(path)
    except OSError as exc:
        exc.filename = exc.filename or str(path)  # a failed read() names no file
        raise


def newest_valid(
    root: Path,
    warn: Callable[[str], None],
    *,
    check: Callable[[Path], dict] = validate,
    paths: Sequence[Path] | None = None,
) -> tuple[Path, dict] | None:
    """The newest generation that passes ``check``; each newer one it refuses is reported through ``warn`` and
    skipped. Raises CheckpointInvalid when generations exist but none is valid: starting from scratch then would
    silently throw away the run's progress.

    ``check(path)`` returns the generation's manifest or raises CheckpointInvalid naming the file at fault; any
    other error (a transient read error: ``validate``) propagates. The default, ``validate``, hashes every file in
    this process. ``paths``: the generations to search, oldest first (default: ``generations(root)``). A collective
    caller (the trainer's ranks, each hashing a share) passes the list every rank received and a check that gives
    every rank the same outcome: the loop then calls it for the same generations in the same order on every rank.
    """
    gens = [p for _, p in generations(root)] if paths is None else list(paths)
    problems = []
    for path in reversed(gens):
        try:
            return path, check(path)
        except CheckpointInvalid as exc:
            problems.append(str(exc))
            warn(f"skipping checkpoint {path.name}: {exc}")
    if gens:
        raise CheckpointInvalid(
            f"none of the {len(gens)} checkpoints in {root} is valid ({'; '.join(problems)}); nothing was deleted. "
            "Move them away to start the run from scratch."
        )
    return None


def latest_committed(root: Path) -> dict | None:
    """The manifest of the newest generation with a manifest, without verifying file hashes (for status)."""
    for _, path in reversed(generations(root)):
        try:
            return validate(path, verify_hashes=False)
        except (CheckpointInvalid, OSError):
            continue
    return None


def write_latest(root: Path, name: str) -> None:
    tmp = root / f"{TMP_PREFIX}{LATEST}"
    tmp.write_text(name + "\n")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_path(root)


def read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def commit(tmp: Path, final: Path, manifest: dict) -> None:
    """Write the manifest into ``tmp`` (fsynced), rename ``tmp`` to ``final``, make it durable, move ``latest``.

    A generation already at ``final`` (an invalid one that was skipped on resume) is set aside, not deleted.
    Re-entrant, for a retry after a transient error: when ``tmp`` is gone and ``final`` holds this very manifest,
    the rename happened already and only the steps after it are done again.
    """
    manifest = dict(manifest)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    if tmp.exists() or _manifest_sha256(final) != manifest["manifest_sha256"]:
        write_json_atomic(tmp / MANIFEST, manifest)
        fsync_path(tmp)
        if final.exists():
            final.rename(final.with_name(f"{final.name}{SET_ASIDE}{os.getpid()}-{time.time_ns()}"))
        tmp.rename(final)
    fsync_path(final.parent)
    write_latest(final.parent, final.name)


def _manifest_sha256(path: Path) -> str | None:
    try:
        return json.loads((path / MANIFEST).read_text()).get("manifest_sha256")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as exc:
        if is_transient(exc):
            raise
        return None


@dataclass(frozen=True)
class Best:
    """checkpoint.keep_best: the ``count`` generations with the best ``metric`` (``mode`` min or max), among those
    evaluated at their own step (a manifest's ``eval`` of that step)."""

    count: int = 0
    metric: str = "eval_loss"
    mode: str = "min"

    def names(self, manifests: list[tuple[str, dict | None]]) -> set[str]:
        """The names to keep of (name, manifest) pairs."""
        if not self.count:
            return set()
        scored = []
        for name, manifest in manifests:
            ev = (manifest or {}).get("eval") or {}
            value = ev.get(self.metric)
            if ev.get("step") == (manifest or {}).get("step") and isinstance(value, int | float) and value == value:
                scored.append((value if self.mode == "min" else -value, name))
        return {name for _, name in sorted(scored)[: self.count]}


NO_BEST = Best()


def prune(root: Path, *, keep_last: int, keep_every: int, verified: set[str] | None = None,
          best: Best = NO_BEST) -> list[Path]:  # fmt: skip
    """Delete valid generations beyond the newest ``keep_last`` valid ones (and not multiples of ``keep_every``, nor
    ``best``'s).

    Called only after a commit. A generation counts toward ``keep_last`` only if it validates, with every file
    hashed unless its name is in ``verified`` (generations this process committed or already verified; the ones
    hashed here are added to it): a damaged newer generation must not push a good one out. Invalid generations,
    uncommitted and set-aside directories are never touched.
    """
    verified = set() if verified is None else verified
    valid: list[tuple[int, Path]] = []
    manifests: list[tuple[str, dict]] = []
    for step, path in reversed(generations(root)):
        hash_files = len(valid) < keep_last and path.name not in verified
        try:
            manifests.append((path.name, validate(path, verify_hashes=hash_files)))
        except CheckpointInvalid:
            continue
        if hash_files:
            verified.add(path.name)
        valid.append((step, path))
    removed = []
    kept_best = best.names(manifests)
    for step, path in valid[keep_last:]:
        if (keep_every and step % keep_every == 0) or path.name in kept_best:
            continue
        # Renamed first: a delete that fails half-way (and is retried, or crashes) leaves a temporary folder, which
        # the next start removes, not a half-deleted generation that looks damaged and is kept.
        doomed = path.with_name(f"{TMP_PREFIX}pruned-{path.name}")
        path.rename(doomed)
        shutil.rmtree(doomed)
        verified.discard(path.name)
        removed.append(path)
    kept = [step for step, path in valid if path not in removed]
    for path in root.glob(f"step_*{SET_ASIDE}*") if kept else []:  # set aside, now older than every kept one
        m = STEP_RE.fullmatch(path.name.split(SET_ASIDE, 1)[0])
        if m and int(m.group(1)) < min(kept):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return sorted(removed)


def remove_stale_tmp(root: Path) -> list[Path]:
    """Remove partial writes left by a crash (``.tmp-*``): by construction they were never committed."""
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                removed.append(p)
    return removed
