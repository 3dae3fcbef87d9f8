"""Writing one checkpoint generation, committing it and pruning the old ones (layout: rundir/checkpoints.py).

The writes (a fresh temporary folder, the model and optimizer through DCP, each rank's own files, the digests of
what each rank wrote) are retried as a unit, on every rank, after a transient storage error; the commit (rank 0:
manifest, fsync, rename, ``latest``) is retried by rank 0 alone. Nothing outside the temporary folder is touched
before the commit, and pruning comes after it.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.tensor import DTensor

from rundir.checkpoints import NO_BEST, TMP_PREFIX, Best, commit, prune, sha256_file
from rundir.identity import RunIdentity, seal_manifest
from storage.files import fsync_path
from storage.ioretry import GaveUp
from trainer.checkpoint.agreement import Agreement, Failed, notes, root_cause
from trainer.checkpoint.fingerprint import tensors_sha256
from trainer.errors import UserError
from trainer.observe.inject import Injector

log = logging.getLogger(__name__)


class CheckpointError(UserError):
    """A checkpoint could not be written; the previous generation is untouched."""


class GenerationWriter:
    """Writes and commits generations into ``root``; ``verified`` (rank 0) collects the names it committed, which
    pruning counts as valid without reading them again."""

    def __init__(
        self,
        *,
        root: Path,
        agreement: Agreement,
        keep_last: int,
        keep_every: int,
        param_names: list[str],
        verified: set[str],
        identity: RunIdentity | None = None,
        injector: Injector | None = None,
        best: Best = NO_BEST,
    ) -> None:
        """``identity`` (rank 0): the run whose name and key every manifest carries (rundir/identity.py)."""
        self.root, self.agreement, self.injector = root, agreement, injector
        self.identity = identity
        self.rank = agreement.rank
        self.keep_last, self.keep_every, self.best = keep_last, keep_every, best
        self.param_names, self.verified = param_names, verified
        self._written: dict = {}  # the digests of the files every rank wrote in the latest write attempt

    def write_and_commit(self, state_dict: dict, files: dict[str, bytes], name: str, meta: dict, step: int) -> None:
        """Write and commit the generation ``name`` (in the background thread with async_save). Collective."""
        tmp = self.root / f"{TMP_PREFIX}{name}"
        if "params_sha256" not in meta:  # whole parameters on every rank: each hashes its share (no comm but this)
            named = [(n, state_dict["model"][n]) for n in self.param_names]
            meta = {**meta, "params_sha256": tensors_sha256(named, self.agreement.group)}
        try:
            self.agreement.retrying(
                f"checkpoint at step {step}", lambda began: self._write(state_dict, files, tmp, began)
            )
            self._commit(tmp, self.root / name, meta)
        except Failed as failed:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # never committed: free the space it took
            raise self.save_failed(failed, step) from failed.cause

    def after_commit(self, name: str) -> None:
        """Rank 0, once ``name`` is committed: count it as valid, then prune the generations it makes old."""
        if self.rank == 0:
            self.verified.add(name)
            removed = self._prune()
            log.info("checkpoint %s committed%s", name, f"; pruned {[p.name for p in removed]}" if removed else "")

    def _write(self, state_dict: dict, files: dict[str, bytes], tmp: Path, began: float) -> None:
        """One attempt at writing the generation into ``tmp``, from a clean folder. Collective."""
        error = None
        if self.rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)  # an earlier attempt's files (or a crashed launch's)
                tmp.mkdir(mode=0o700, parents=True)
            except OSError as exc:
                error = (exc, f"cannot create {tmp}: {exc.strerror or exc}")
        self.agreement.agree(error, began)
        # Then each rank's part, up to its first failure: DCP's files (DCP itself makes every rank raise when one
        # rank's write fails), this rank's own files, and the digests of what it wrote (1/N of the generation). One
        # agreement for the three: every rank learns every failure, and rank 0 the digests for the manifest.
        error, mine = None, {}
        try:
            dcp.save(state_dict, storage_writer=self._dcp_writer(tmp / "dcp"), process_group=self.agreement.group)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException wrapping per-rank errors
            error = (exc, f"writing the model and optimizer state failed: {root_cause(exc)}{_space_note(tmp)}")
        if error is None:
            error = self._write_own(files, tmp)
        if error is None:
            try:
                mine = hash_files(tmp, own_files(tmp, self.rank))
            except OSError as exc:
                error = (exc, f"reading back {getattr(exc, 'filename', None) or tmp}: {root_cause(exc)}")
        parts = self.agreement.agree(error, began, payload=mine)
        self._written = {k: v for part in parts for k, v in part.items()}

    def _write_own(self, files: dict[str, bytes], tmp: Path) -> tuple[BaseException, str] | None:
        """This rank's own files into ``tmp``; the first failure, as ``Agreement.agree`` takes it."""
        for file_name, data in files.items():
            path = tmp / file_name
            try:
                self._write_file(path, data)
            except OSError as exc:
                return exc, f"cannot write {path}: {root_cause(exc)}{_space_note(tmp)}"
        return None

    def _commit(self, tmp: Path, final: Path, meta: dict) -> None:
        """Rank 0 hashes the files into the manifest and commits (each retried alone); every rank learns the
        outcome. A commit that fails is not retried as a unit: its rename may have happened."""
        error = None
        if self.rank == 0:
            alone = self.agreement.alone
            try:
                manifest = alone(lambda: {**meta, "files": self._files_of(tmp), "committed_at": time.time()}, tmp)
                if self.identity is not None:
                    manifest = seal_manifest(manifest, self.identity)
                alone(lambda: commit(tmp, final, manifest), final)
            except OSError as exc:
                error = (exc, f"committing {final} failed: {exc.strerror or exc}{notes(exc)}")
        self.agreement.agree(error, time.monotonic(), final=True)

    def _files_of(self, tmp: Path) -> dict:
        """Rank 0: the manifest's file list, the digests every rank gathered for its own files, plus any file no
        rank claimed (a DCP that names its files otherwise), hashed here; then every folder fsynced."""
        files = dict(self._written)
        stray = sorted(p for p in tmp.rglob("*") if p.is_file() and p.relative_to(tmp).as_posix() not in files)
        if stray:
            log.debug("hashing %d file(s) no rank claimed: %s", len(stray), [p.name for p in stray[:5]])
            files.update(hash_files(tmp, stray))
        fsync_all_dirs(tmp)
        return dict(sorted(files.items()))

    def _dcp_writer(self, path: Path) -> dcp.FileSystemWriter:
        writer = dcp.FileSystemWriter(path, sync_files=True)
        if self.injector is not None and self.injector.injects("eio_save"):
            writer.fs = _HookedFileSystem(self.injector.checkpoint_write)  # tests: faults in DCP's own writes
        return writer

    def _write_file(self, path: Path, data: bytes) -> None:
        if self.injector is not None:
            self.injector.checkpoint_write(path)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def _prune(self) -> list[Path]:
        """Prune after a commit (rank 0); a prune that keeps failing is logged and left to the next commit."""
        try:
            return self.agreement.alone(
                lambda: prune(
                    self.root,
                    keep_last=self.keep_last,
                    keep_every=self.keep_every,
                    verified=self.verified,
                    best=self.best,
                ),
                self.root,
            )
        except OSError as exc:
            log.warning("pruning old checkpoints in %s failed (%s); they stay until the next commit", self.root, exc)
            return []

    def save_failed(self, failed: Failed, step: int) -> Exception:
        """A save that failed on some rank, as every rank raises it: bad input or a full disk (a user error: not
        retried), or transient storage errors that outlived checkpoint.io_retries (a crash: restarted)."""
        first = next((r for r in failed.reports if not r["transient"]), failed.reports[0])
        message = f"rank {first['rank']}: checkpoint at step {step} could not be saved: {first['message']}"
        intact = f"The previous checkpoint, if any, is intact in {self.root}."
        if not failed.transient:
            return CheckpointError(f"{message}. {intact}", collective=True)
        return GaveUp(first["errno"], f"{message}{self.agreement.gave_up_after(failed)}. {intact}")


class _HookedFileSystem(FileSystem):
    """DCP's local file system with a hook called before each file it opens for writing (fault injection)."""

    def __init__(self, before_write: Callable[[Path], None]) -> None:
        super().__init__()
        self.before_write = before_write

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" in mode:
            self.before_write(Path(path))
        with super().create_stream(path, mode) as stream:
            yield stream


def stage(obj, buf):
    """Copy a (nested) state dict into CPU buffers, reusing ``buf`` from the previous save where shapes match.

    Reuse is safe because a save starts only after the previous one is committed; copying into warm buffers is
    several times faster than allocating fresh ones.
    """
    if isinstance(obj, DTensor):  # a shard (FSDP2): stage this rank's part, keep its place in the whole
        local = stage(obj.to_local(), buf.to_local() if isinstance(buf, DTensor) else None)
        return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                  stride=obj.stride())  # fmt: skip
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if not (isinstance(buf, torch.Tensor) and buf.shape == src.shape and buf.dtype == src.dtype):
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
        buf.copy_(src, non_blocking=src.is_cuda)
        return buf
    if isinstance(obj, dict):
        old = buf if isinstance(buf, dict) else {}
        return {k: stage(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, list):
        old = buf if isinstance(buf, list) and len(buf) == len(obj) else [None] * len(obj)
        return [stage(v, b) for v, b in zip(obj, old, strict=True)]
    return obj


def torch_bytes(obj: object) -> bytes:
    """``torch.save`` into memory: the bytes are written with plain file I/O, whose errors keep their errno
    (``torch.save`` to a path reports a failed write as a RuntimeError without one)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def json_bytes(data: dict) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode()


def own_files(tmp: Path, rank: int) -> list[Path]:
    """The files of a generation that ``rank`` wrote: its DCP data files (``__RANK_*.distcp``, DCP's naming) and
    its RNG file; rank 0 also DCP's ``.metadata`` and ``train_state.json``."""
    paths = sorted((tmp / "dcp").glob(f"__{rank}_*.distcp")) + [tmp / f"rank_{rank:05d}.pt"]
    if rank == 0:
        paths += [tmp / "dcp" / ".metadata", tmp / "train_state.json"]
    return [p for p in paths if p.is_file()]


def hash_files(tmp: Path, paths: list[Path]) -> dict:
    """Size and SHA-256 of ``paths`` (files under ``tmp``), keyed by their path relative to ``tmp``."""
    return {p.relative_to(tmp).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in paths}


def fsync_all_dirs(root: Path) -> None:
    for dirpath, _, _ in os.walk(root):
        fsync_path(Path(dirpath))


def _space_note(folder: Path) -> str:
    """Torch's file writer reports a full disk as a bare RuntimeError: say so when the disk is (nearly) full."""
    try:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
    except OSError:
        return ""
    return f" (the file system holding {folder.parent} is full: {free} bytes free)" if free < (1 << 20) else ""
