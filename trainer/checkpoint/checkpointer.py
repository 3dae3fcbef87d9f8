"""Saving and restoring training state as atomic checkpoint generations (layout: runconfig/checkpoints.py).

Model and optimizer go through torch.distributed.checkpoint (DCP), so a run with another number of ranks can
load them; each rank adds its RNG states (``rank_NNNNN.pt``, loaded with ``weights_only=True``) and rank 0 the
loop state (``train_state.json``). Rank 0 commits: per-file SHA-256 into ``manifest.json``, fsync, rename,
``latest``, then prunes old generations. With ``async_save`` the state is first copied to CPU memory and a
background thread writes and commits it while training goes on, on a process group of its own.

A transient storage error (EIO, ESTALE, ...: runconfig/ioretry.py) is retried with back-off (checkpoint.io_retries):
a save's writes as a unit on every rank, from a fresh temporary folder; its commit and the reads of a restore alone.
When the retries are exhausted every rank raises the same ``GaveUp``: the launch fails as a crash and is restarted.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mpi4py import MPI
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from runconfig import RunConfig, RunDir
from runconfig.checkpoints import (
    TMP_PREFIX,
    CheckpointInvalid,
    commit,
    fsync_path,
    generations,
    newest_valid,
    prune,
    remove_stale_tmp,
    sha256_file,
    step_name,
    validate,
)
from runconfig.ioretry import BUDGET_S, GaveUp, RetryPolicy, describe, io_errno, is_transient, retry
from runconfig.load import config_hash
from trainer.checkpoint.fingerprint import owners, params_sha256, params_sha256_v1, tensors_sha256
from trainer.checkpoint.kernels import kernels, restore_kernels
from trainer.checkpoint.provenance import git_commit, versions
from trainer.checkpoint.rng import rng_state, seed_rank, set_rng_state
from trainer.checkpoint.state import TrainState
from trainer.env import RuntimeEnv, patient_allgather, patient_bcast
from trainer.errors import UserError
from trainer.observe.inject import Injector

log = logging.getLogger(__name__)
T = TypeVar("T")
FORMAT = 4  # 4: the optimizer state flattened per parameter (a pipeline stage's param groups list only its own
# parameters: as one list per group, stages would overwrite each other's); 3: params_sha256 from per-parameter
# digests (fingerprint.py); 2: the recipe, its architecture and the parameter shapes identify the model; 1: the
# GPT's config
READABLE = (2, 3, 4)  # 2 differs only in its params_sha256 (params_sha256_v1), 3 in its nested optimizer state


def _options(fmt: int = FORMAT, **more) -> StateDictOptions:
    """How a checkpoint of format ``fmt`` holds the model and optimizer state (DCP state dicts)."""
    return StateDictOptions(flatten_optimizer_state_dict=fmt >= 4, **more)


class CheckpointError(UserError):
    """A checkpoint could not be written; the previous generation is untouched."""


class _Failed(Exception):
    """A phase of a collective save or load failed on some rank: raised on every rank with every rank's report
    (``Checkpointer._agree``), so that every rank takes the same decision. ``cause``: this rank's own exception."""

    def __init__(self, reports: list[dict], elapsed_s: float, cause: BaseException | None) -> None:
        super().__init__(reports[0]["message"])
        self.reports, self.elapsed_s, self.cause = reports, elapsed_s, cause
        self.attempts = 1

    @property
    def transient(self) -> bool:
        return all(r["transient"] for r in self.reports)

    @property
    def retryable(self) -> bool:
        return self.transient and not any(r["final"] for r in self.reports)


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


def _stage(obj, buf):
    """Copy a (nested) state dict into CPU buffers, reusing ``buf`` from the previous save where shapes match.

    Reuse is safe because a save starts only after the previous one is committed; copying into warm buffers is
    several times faster than allocating fresh ones.
    """
    if isinstance(obj, DTensor):  # a shard (FSDP2): stage this rank's part, keep its place in the whole
        local = _stage(obj.to_local(), buf.to_local() if isinstance(buf, DTensor) else None)
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
        return {k: _stage(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, list):
        old = buf if isinstance(buf, list) and len(buf) == len(obj) else [None] * len(obj)
        return [_stage(v, b) for v, b in zip(obj, old, strict=True)]
    return obj


def _torch_bytes(obj: object) -> bytes:
    """``torch.save`` into memory: the bytes are written with plain file I/O, whose errors keep their errno
    (``torch.save`` to a path reports a failed write as a RuntimeError without one)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def own_files(tmp: Path, rank: int) -> list[Path]:
    """The files of a generation that ``rank`` wrote: its DCP data files (``__RANK_*.distcp``, DCP's naming) and
    its RNG file; rank 0 also DCP's ``.metadata`` and ``train_state.json``."""
    paths = sorted((tmp / "dcp").glob(f"__{rank}_*.distcp")) + [tmp / f"rank_{rank:05d}.pt"]
    if rank == 0:
        paths += [tmp / "dcp" / ".metadata", tmp / "train_state.json"]
    return [p for p in paths if p.is_file()]


def _hash_files(tmp: Path, paths: list[Path]) -> dict:
    """Size and SHA-256 of ``paths`` (files under ``tmp``), keyed by their path relative to ``tmp``."""
    return {p.relative_to(tmp).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in paths}


def shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """The files each rank verifies at restore: largest first to the least-loaded rank (deterministic)."""
    names = sorted(sizes)
    who = owners([sizes[n] for n in names], world)
    return [[n for n, r in zip(names, who, strict=True) if r == rank] for rank in range(world)]


class Checkpointer:
    def __init__(
        self,
        *,
        cfg: RunConfig,
        env: RuntimeEnv,
        rundir: RunDir,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: MPI.Comm,
        architecture: dict | None = None,
        code_sha256: str | None = None,
        injector: Injector | None = None,
        param_shapes: dict | None = None,
        aliases: dict[str, str] | None = None,
    ) -> None:
        """``model`` is the bare module (parameter names without DDP's "module."; under pipeline parallelism this
        rank's stage); ``architecture`` the recipe's settings that define the model beyond its shapes;
        ``code_sha256`` the recipe's code snapshot; ``injector`` the faults injected by tests (``eio_save``);
        ``param_shapes`` the whole model's {name: [*shape, dtype]} (default: ``model``'s); ``aliases`` {name of a
        tied copy: the whole model's name} (a pipeline's output head tied to the first stage's embedding): left out
        of ``params_sha256``, its optimizer state read under the whole model's name."""
        self.cfg, self.env, self.comm = cfg, env, comm
        self.model, self.optimizer = model, optimizer
        self.identity = {
            "recipe": cfg.recipe,
            "architecture": dict(architecture or {}),
            "param_shapes": param_shapes or {n: [*p.shape, str(p.dtype)] for n, p in model.named_parameters()},
        }
        local = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        # The tied copies this rank holds apart from their whole-model name (a pipeline's last stage: the head).
        self.aliases = {a: w for a, w in (aliases or {}).items() if a in local and w not in local}
        self.code_sha256 = code_sha256
        self.root = rundir.checkpoints
        self.ccfg = cfg.checkpoint
        self.injector = injector
        # Retries end well within the collective timeout: the other ranks wait in one while a rank retries alone.
        self.retry = RetryPolicy(
            self.ccfg.io_retries,
            self.ccfg.io_retry_backoff_s,
            "checkpoint.io_retries",
            budget_s=min(BUDGET_S, cfg.comm.timeout_s / 2),
        )
        # A background save has a gloo group of its own, so that it never interleaves with the training collectives
        # (and so does a save under NCCL: its files' digests and DCP's plan travel as CPU objects). A save in the
        # training thread over gloo runs between the steps' collectives, on the default group: each gloo group keeps
        # a thread that wakes every 10 ms (HierGroups.release).
        own = self.ccfg.async_save or dist.get_backend() != "gloo"
        self.group: dist.ProcessGroup | None = dist.new_group(backend="gloo") if own else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt") if self.ccfg.async_save else None
        self.pending: Future | None = None
        self.param_names = [name for name, _ in model.named_parameters() if name not in (aliases or {})]
        self.sharded = any(isinstance(p, DTensor) for p in model.parameters())
        self._staging: dict | None = None  # CPU buffers reused by async saves
        self._written: dict = {}  # the digests of the files every rank wrote in the latest write attempt
        self.last_commit_time = time.monotonic()
        self.blocking_s: list[float] = []  # time the training loop waited per save
        self.last_save_s: float | None = None  # the newest committed save's seconds, save() -> committed
        self.verified: set[str] = set()  # generations this process committed or fully verified (rank 0)
        self.skipped: list[str] = []  # rank 0: why the restore passed over newer generations (damaged ones)

    # -- when ---------------------------------------------------------------------------------------------
    def due_by_steps(self, step: int, final: bool) -> bool:
        every = self.ccfg.every_steps
        return bool(every and step % every == 0) or (final and self.ccfg.at_end)

    def due_by_time(self) -> bool:
        """Rank 0's clock decides; the loop shares this flag with the other ranks in its step collective."""
        minutes = self.ccfg.every_minutes
        return bool(minutes) and time.monotonic() - self.last_commit_time >= 60 * minutes

    # -- save ---------------------------------------------------------------------------------------------
    def save(self, state: TrainState, *, block: bool) -> None:
        """Write the generation for ``state.step``. Blocks for the CPU copy only (async), or until committed."""
        start = time.perf_counter()
        self.wait()  # never two writes at once
        name = step_name(state.step)
        # This rank's own files, serialised now: every attempt of the save (in the background with async_save)
        # writes these same bytes, whatever the loop has done since.
        files = {f"rank_{self.env.rank:05d}.pt": _torch_bytes({"rng": rng_state()})}
        if self.env.rank == 0:
            files["train_state.json"] = (json.dumps(state.state_dict(), indent=2) + "\n").encode()
        msd, osd = get_state_dict(self.model, self.optimizer, options=_options())
        meta = self._manifest(state)
        if self.sharded:  # gathering whole parameters is collective: here, not in a background save's thread
            meta["params_sha256"] = params_sha256(self.model, skip=self.aliases)
        if self.pool is None:
            self._write_and_commit({"model": msd, "optim": osd}, files, name, meta, state.step, start)
        else:
            staged = self._staging = _stage({"model": msd, "optim": osd}, self._staging)
            if any(t.is_cuda for t in msd.values() if isinstance(t, torch.Tensor)):
                torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
            self.pending = self.pool.submit(self._write_and_commit, staged, files, name, meta, state.step, start)
            if block:
                self.wait()
        self.blocking_s.append(time.perf_counter() - start)

    def wait(self) -> None:
        """Wait for a background save to be committed (re-raising its error)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)

    def _write_and_commit(
        self, state_dict: dict, files: dict[str, bytes], name: str, meta: dict, step: int, start: float
    ) -> None:
        """Write and commit one generation (in the background thread with async_save). The writes (a fresh
        temporary folder, the model and optimizer through DCP, each rank's own files) are retried as a unit, on
        every rank, after a transient storage error; the commit is retried by rank 0 alone (it is re-entrant).
        Nothing outside the temporary folder is touched before the commit, and pruning comes after it."""
        tmp = self.root / f"{TMP_PREFIX}{name}"
        if "params_sha256" not in meta:  # whole parameters on every rank: each hashes its share (no comm but this)
            named = [(n, state_dict["model"][n]) for n in self.param_names]
            meta = {**meta, "params_sha256": tensors_sha256(named, self.group)}
        try:
            self._retrying(f"checkpoint at step {step}", lambda began: self._write(state_dict, files, tmp, began))
            self._commit(tmp, self.root / name, meta)
        except _Failed as failed:
            if self.env.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # never committed: free the space it took
            raise self._save_failed(failed, step) from failed.cause
        self.last_commit_time = time.monotonic()
        self.last_save_s = time.perf_counter() - start
        if self.env.rank == 0:
            self.verified.add(name)
            removed = self._prune()
            log.info("checkpoint %s committed%s", name, f"; pruned {[p.name for p in removed]}" if removed else "")

    def _write(self, state_dict: dict, files: dict[str, bytes], tmp: Path, began: float) -> None:
        """One attempt at writing the generation into ``tmp``, from a clean folder. Collective."""
        error = None
        if self.env.rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)  # an earlier attempt's files (or a crashed launch's)
                tmp.mkdir(mode=0o700, parents=True)
            except OSError as exc:
                error = (exc, f"cannot create {tmp}: {exc.strerror or exc}")
        self._agree(error, began)
        # Then each rank's part, up to its first failure: DCP's files (DCP itself makes every rank raise when one
        # rank's write fails), this rank's own files, and the digests of what it wrote (1/N of the generation). One
        # agreement for the three: every rank learns every failure, and rank 0 the digests for the manifest.
        error, mine = None, {}
        try:
            dcp.save(state_dict, storage_writer=self._dcp_writer(tmp / "dcp"), process_group=self.group)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException wrapping per-rank errors
            error = (exc, f"writing the model and optimizer state failed: {_root_cause(exc)}{_space_note(tmp)}")
        if error is None:
            error = self._write_own(files, tmp)
        if error is None:
            try:
                mine = _hash_files(tmp, own_files(tmp, self.env.rank))
            except OSError as exc:
                error = (exc, f"reading back {getattr(exc, 'filename', None) or tmp}: {_root_cause(exc)}")
        parts = self._agree(error, began, payload=mine)
        self._written = {k: v for part in parts for k, v in part.items()}

    def _write_own(self, files: dict[str, bytes], tmp: Path) -> tuple[BaseException, str] | None:
        """This rank's own files into ``tmp``; the first failure, as ``_agree`` takes it."""
        for file_name, data in files.items():
            path = tmp / file_name
            try:
                self._write_file(path, data)
            except OSError as exc:
                return exc, f"cannot write {path}: {_root_cause(exc)}{_space_note(tmp)}"
        return None

    def _commit(self, tmp: Path, final: Path, meta: dict) -> None:
        """Rank 0 hashes the files into the manifest and commits (each retried alone); every rank learns the outcome.
        A commit that fails is not retried as a unit: its rename may have happened."""
        error = None
        if self.env.rank == 0:
            try:
                manifest = self._retry(lambda: {**meta, "files": self._files_of(tmp), "committed_at": time.time()}, tmp)
                self._retry(lambda: commit(tmp, final, manifest), final)
            except OSError as exc:
                error = (exc, f"committing {final} failed: {exc.strerror or exc}{_notes(exc)}")
        self._agree(error, time.monotonic(), final=True)

    def _files_of(self, tmp: Path) -> dict:
        """Rank 0: the manifest's file list, the digests every rank gathered for its own files, plus any file no
        rank claimed (a DCP that names its files otherwise), hashed here; then every folder fsynced."""
        files = dict(self._written)
        stray = sorted(p for p in tmp.rglob("*") if p.is_file() and p.relative_to(tmp).as_posix() not in files)
        if stray:
            log.debug("hashing %d file(s) no rank claimed: %s", len(stray), [p.name for p in stray[:5]])
            files.update(_hash_files(tmp, stray))
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
            return self._retry(
                lambda: prune(
                    self.root, keep_last=self.ccfg.keep_last, keep_every=self.ccfg.keep_every, verified=self.verified
                ),
                self.root,
            )
        except OSError as exc:
            log.warning("pruning old checkpoints in %s failed (%s); they stay until the next commit", self.root, exc)
            return []

    def _retry(self, fn: Callable[[], T], path: Path) -> T:
        """``fn()`` on this rank alone, retried after transient storage errors (checkpoint.io_retries)."""
        return retry(fn, self.retry, what="checkpoint I/O on", path=path, log=log)

    def _retrying(self, what: str, attempt: Callable[[float], None]) -> None:
        """``attempt(began)`` on every rank, again on every rank while its failures are all transient and
        checkpoint.io_retries allows: the decision depends only on what ``_agree`` gathered, so every rank takes
        the same one. Raises the last ``_Failed``."""
        began = time.monotonic()
        for n in itertools.count(1):
            try:
                return attempt(began)
            except _Failed as failed:
                failed.attempts = n
                if not (failed.retryable and self.retry.allows(n, failed.elapsed_s)):
                    raise
                delay = self.retry.jittered(n)
                for r in failed.reports:
                    log.warning(
                        "%s: rank %d: %s failed with %s, attempt %d/%d; every rank retries in %.2f s",
                        what,
                        r["rank"],
                        r["file"],
                        r["error"],
                        n,
                        self.retry.attempts,
                        delay,
                    )
                time.sleep(delay)

    def _agree(
        self, error: tuple[BaseException, str] | None, began: float, *, final: bool = False, payload: Any = None
    ) -> list:
        """Every rank learns every rank's failure of this phase, on the checkpoint group (safe from the background
        thread): if any rank failed, every rank raises ``_Failed`` with the same reports. ``error`` is this rank's
        (exception, one-line message); ``final``: not to be retried as a unit."""
        report = None
        if error is not None:
            origin, cause = _origin(error[0], self.env.rank)
            report = {
                "rank": origin,
                "message": error[1],
                "file": str(getattr(cause, "filename", None) or "a file"),
                "error": describe(cause),
                "errno": io_errno(cause),
                "transient": is_transient(cause),
                "final": final,
            }
        gathered: list = [None] * self.env.world_size
        dist.all_gather_object(gathered, (report, time.monotonic() - began, payload), group=self.group)
        reports = list({(r["rank"], r["message"]): r for r, _, _ in gathered if r}.values())
        if reports:
            raise _Failed(reports, max(e for _, e, _ in gathered), error[0] if error else None)
        return [p for _, _, p in gathered]

    def _save_failed(self, failed: _Failed, step: int) -> Exception:
        """A save that failed on some rank, as every rank raises it: bad input or a full disk (a user error: not
        retried), or transient storage errors that outlived checkpoint.io_retries (a crash: restarted)."""
        first = next((r for r in failed.reports if not r["transient"]), failed.reports[0])
        message = f"rank {first['rank']}: checkpoint at step {step} could not be saved: {first['message']}"
        intact = f"The previous checkpoint, if any, is intact in {self.root}."
        if not failed.transient:
            return CheckpointError(f"{message}. {intact}", collective=True)
        return GaveUp(first["errno"], f"{message}{self._gave_up_after(failed)}. {intact}")

    def _gave_up_after(self, failed: _Failed) -> str:
        """How a unit of every rank ended after its retries (a commit's message says so itself)."""
        if failed.reports[0]["final"]:
            return ""
        return (
            f" (a transient error on {failed.attempts} attempt(s) over {failed.elapsed_s:.1f} s, "
            f"checkpoint.io_retries={self.retry.retries})"
        )

    def _manifest(self, state: TrainState) -> dict:
        return {
            "format": FORMAT,
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            "data_position": state.data_position,
            "loss": state.last_loss,
            "world_size": self.env.world_size,
            "topology": self.env.topology.describe(),
            "config_sha256": config_hash(self.cfg),
            **self.identity,
            "recipe_args": self.cfg.recipe_args,
            "code_sha256": self.code_sha256,
            "optimizer": {"type": type(self.optimizer).__name__},
            "git_commit": git_commit(),
            "versions": versions(),
            "slurm_job_id": self.env.slurm_job_id,
            "slurm_restart_count": self.env.slurm_restart_count,
            "wall_time_s": state.elapsed_s,
        }

    # -- restore ------------------------------------------------------------------------------------------
    def restore(self, state: TrainState) -> bool:
        """Load the newest valid generation into the model, optimizer, RNGs and ``state``. Collective.

        Returns False when the run directory has no checkpoint yet. Reads that fail with a transient storage error
        are retried (checkpoint.io_retries): such an error never makes a generation count as invalid.
        """
        found = self._find()
        if found is None:
            return False
        path, manifest = found
        if self.env.rank == 0:
            log.info("restoring %s (step %d)", path.name, manifest["step"])
        changed = self._check_compatible(manifest, path)
        try:
            fmt = manifest["format"]
            self._retrying(f"loading checkpoint {path.name}", lambda began: self._load(path, changed, fmt, began))
        except _Failed as failed:
            first = failed.reports[0]
            message = f"rank {first['rank']}: loading checkpoint {path} failed: {first['message']}"
            if failed.transient:
                raise GaveUp(first["errno"], f"{message}{self._gave_up_after(failed)}") from failed.cause
            raise RuntimeError(message) from failed.cause
        loaded = params_sha256(self.model, skip=self.aliases) if manifest.get("format", 1) >= 3 else None
        if not changed and loaded is None:  # an older manifest: its fingerprint covers every byte in one hash
            loaded = params_sha256_v1(self.model.named_parameters())
        if not changed and loaded != manifest["params_sha256"]:
            raise UserError(
                f"checkpoint {path}: the loaded parameters do not match the manifest's params_sha256.",
                collective=True,
            )
        state.load_state_dict(json.loads(self._read(path / "train_state.json")))
        if manifest["world_size"] == self.env.world_size:
            rank_file = path / f"rank_{self.env.rank:05d}.pt"
            set_rng_state(torch.load(io.BytesIO(self._read(rank_file)), weights_only=True)["rng"])
        else:  # per-rank streams cannot be mapped to another world size: derive fresh ones deterministically
            seed_rank(self.cfg.train.seed, self.env.rank, state.step)
        if self.env.rank == 0:
            log.info("resumed from %s (step %d, saved by %d ranks)", path.name, state.step, manifest["world_size"])
        self.last_commit_time = time.monotonic()
        return True

    def _find(self) -> tuple[Path, dict] | None:
        """The newest generation that validates (``newest_valid``), each rank hashing its share of the files
        (``_check``): none reads the whole generation. A newer invalid one is skipped with a warning; when
        generations exist but none is valid the run stops (starting from scratch would throw its progress away).
        Reads that fail with a transient storage error are retried (checkpoint.io_retries) and never make a
        generation count as invalid. Collective (MPI, main thread): the list of generations is rank 0's, and
        ``_check`` gives every rank the same outcome, so every rank checks the same generations in the same order."""
        gens = crash = None
        if self.env.rank == 0:
            try:
                gens = self._retry(lambda: [str(p) for p in self._generations()], self.root)
            except OSError as exc:
                crash = _read_failed(exc, f"the checkpoints in {self.root}")
        gens, crash = patient_bcast(self.comm, (gens, crash))  # rank 0 listed them alone
        _raise_crash(crash)
        self.skipped = []

        def warn(message: str) -> None:  # rank 0: logged, and kept for the resume event
            if self.env.rank == 0:
                log.warning("%s", message)
                self.skipped.append(message)

        try:
            found = newest_valid(self.root, warn, check=self._check, paths=[Path(p) for p in gens])
        except CheckpointInvalid as exc:
            raise UserError(str(exc), collective=True) from None
        if found is not None and self.env.rank == 0:
            self.verified.add(found[0].name)
        return found

    def _generations(self) -> list[Path]:
        """Rank 0: the generations, oldest first, after removing the partial writes of a crashed save."""
        remove_stale_tmp(self.root)
        return [p for _, p in generations(self.root)]

    def _check(self, path: Path) -> dict:
        """The manifest of generation ``path`` if it is valid: rank 0 reads the manifest and checks the sizes, each
        rank hashes its share of the files. Every rank returns the same manifest or raises the same error:
        CheckpointInvalid naming the file at fault; GaveUp (a transient error that outlived the retries) or
        UserError (an unreadable file). Collective."""
        manifest = problem = crash = None
        if self.env.rank == 0:
            try:
                manifest = self._retry(lambda: validate(path, verify_hashes=False), path)
            except CheckpointInvalid as exc:
                problem = str(exc)
            except OSError as exc:
                crash = _read_failed(exc, str(path))
        manifest, problem, crash = patient_bcast(self.comm, (manifest, problem, crash))  # rank 0 read it alone
        if not crash and not problem:
            reports = patient_allgather(self.comm, self._verify_share(path, manifest["files"]))  # shares differ
            crash = next((c for _, c in reports if c), None)
            problem = next((p for p, _ in reports if p), None)
        _raise_crash(crash)
        if problem:
            raise CheckpointInvalid(problem)
        return manifest

    def _verify_share(self, path: Path, files: dict) -> tuple[str | None, tuple | None]:
        """(problem, crash) of this rank's share of the generation's files: a digest that differs, a file that
        cannot be read; crash: (errno, message) of a transient error that outlived the retries."""
        sizes = {rel: int(meta["size"]) for rel, meta in files.items()}
        for rel in shares(sizes, self.env.world_size)[self.env.rank]:
            fpath = path / rel
            try:
                if self._retry(lambda f=fpath: sha256_file(f), fpath) != files[rel]["sha256"]:
                    return f"{fpath} does not match its SHA-256 in the manifest (corrupt)", None
            except OSError as exc:
                if is_transient(exc):
                    return None, _read_failed(exc, str(fpath))
                return f"{fpath} cannot be read ({exc.strerror or exc})", None
        return None, None

    def _read(self, path: Path) -> bytes:
        return self._retry(path.read_bytes, path)

    def _load(self, path: Path, changed: dict[str, tuple | str], fmt: int, began: float) -> None:
        """One attempt at loading the model and optimizer state through DCP. Collective."""
        error = None
        kept = kernels(self.optimizer)  # the run's own kernel choice, which the load overwrites (kernels.py)
        try:
            if changed:
                self._warm_start(path, changed, fmt)
            else:
                msd, osd = get_state_dict(self.model, self.optimizer, options=_options(fmt))
                osd = _renamed(osd, self.aliases)  # a tied copy's moments: read under the whole model's name
                dcp.load({"model": msd, "optim": osd}, checkpoint_id=path / "dcp", process_group=self.group)
                osd = _renamed(osd, {whole: alias for alias, whole in self.aliases.items()})
                set_state_dict(
                    self.model, self.optimizer, model_state_dict=msd, optim_state_dict=osd, options=_options(fmt)
                )
        except (Exception, CheckpointException) as exc:
            error = (exc, f"reading {path / 'dcp'}: {_root_cause(exc)}")
        differed = restore_kernels(self.optimizer, kept)
        if differed and self.env.rank == 0 and error is None:
            log.info(
                "optimizer kernels: %s saved them otherwise (%s); this run's are kept (train.optimizer_impl, or the "
                "recipe's own optimizer): the moments and hyperparameters load as saved, the last bits of later steps "
                "may differ from a run that kept the saved kernels",
                path.name,
                ", ".join(differed),
            )
        self._agree(error, began)

    def _check_compatible(self, manifest: dict, path: Path) -> dict[str, tuple | str]:
        """What identifies the model and optimizer and differs from the checkpoint's: the recipe, its
        architecture settings, a parameter's name, shape or dtype, the optimizer's type. Refused unless
        allow_shape_change. (Dropout and other settings that change no tensor are not part of it.)"""
        if manifest.get("format") not in READABLE:
            raise UserError(
                f"checkpoint {path} has format {manifest.get('format')}, this trainer reads formats "
                f"{', '.join(map(str, READABLE))}; resume "
                "it with the trainer version that wrote it, or start a new run directory. Nothing was deleted.",
                collective=True,
            )
        changed: dict[str, tuple | str] = {}
        if manifest["recipe"] != self.identity["recipe"]:
            changed["recipe"] = (manifest["recipe"], self.identity["recipe"])
        saved_arch, arch = manifest["architecture"], self.identity["architecture"]
        for key in [*arch, *(k for k in saved_arch if k not in arch)]:
            if saved_arch.get(key) != arch.get(key):
                changed[key] = (saved_arch.get(key), arch.get(key))
        saved, now = manifest["param_shapes"], self.identity["param_shapes"]
        differ = {
            "new": sorted(set(now) - set(saved)),
            "gone": sorted(set(saved) - set(now)),
            "reshaped": sorted(n for n in set(now) & set(saved) if now[n] != saved[n]),
        }
        if any(differ.values()):
            changed["parameters"] = "; ".join(
                f"{len(names)} {kind} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                for kind, names in differ.items()
                if names
            )
        if manifest["optimizer"]["type"] != type(self.optimizer).__name__:
            changed["optimizer"] = (manifest["optimizer"]["type"], type(self.optimizer).__name__)
        if changed and not self.ccfg.allow_shape_change:
            raise UserError(
                f"checkpoint {path} was saved with another model or optimizer ({_describe(changed)}); refusing to "
                "resume. "
                "Set checkpoint.allow_shape_change=true to force it (a warm start: tensors whose shape still "
                "matches are loaded, the rest keep their fresh initialisation), or use a new run directory. "
                "Nothing was deleted.",
                collective=True,
            )
        return changed

    def _warm_start(self, path: Path, changed: dict[str, tuple | str], fmt: int) -> None:
        """Forced resume across a model/optimizer change: load every parameter whose name and shape still match.

        The optimizer state is loaded only when every parameter loaded and the optimizer type is unchanged;
        otherwise it starts fresh (its moments would belong to other tensors).
        """
        model, optimizer = self.model, self.optimizer
        msd, osd = get_state_dict(model, optimizer, options=_options(fmt))
        saved = dcp.FileSystemReader(path / "dcp").read_metadata().state_dict_metadata
        fits = {
            k: v
            for k, v in msd.items()
            if (m := saved.get(f"model.{k}")) is not None and tuple(getattr(m, "size", ())) == tuple(v.shape)
        }
        fresh = sorted(set(msd) - set(fits))
        with_optim = not fresh and "optimizer" not in changed
        state = {"model": fits, "optim": osd} if with_optim else {"model": fits}
        dcp.load(state, checkpoint_id=path / "dcp", process_group=self.group)
        set_model_state_dict(model, fits, options=_options(fmt, strict=False))
        if with_optim:
            set_optimizer_state_dict(model, optimizer, osd, options=_options(fmt))
        if self.env.rank == 0:
            log.warning(
                "checkpoint.allow_shape_change: resuming from %s across a change (%s): loaded %d of %d tensors%s; "
                "optimizer state %s",
                path.name,
                _describe(changed),
                len(fits),
                len(msd),
                f", fresh initialisation kept for {fresh}" if fresh else "",
                "loaded" if with_optim else "reset",
            )


def _describe(changed: dict[str, tuple | str]) -> str:
    items = [f"{k}: {v}" if isinstance(v, str) else f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in changed.items()]
    return ", ".join(items[:6]) + (f" and {len(items) - 6} more" if len(items) > 6 else "")


def _renamed(osd: dict, names: dict[str, str]) -> dict:
    """An optimizer state dict (as ``get_state_dict`` gives it: FQN-keyed, flattened per parameter or nested) with
    parameters renamed."""
    if not names:
        return osd
    if "state" in osd and "param_groups" in osd:  # nested (format 3)
        state = {names.get(k, k): v for k, v in osd["state"].items()}
        groups = [{**g, "params": [names.get(n, n) for n in g["params"]]} for g in osd["param_groups"]]
        return {"state": state, "param_groups": groups}
    out = {}
    for key, value in osd.items():  # "state.<fqn>.<name>", "param_groups.<fqn>.<name>"
        kind, _, rest = key.partition(".")
        fqn, _, leaf = rest.rpartition(".")
        out[f"{kind}.{names.get(fqn, fqn)}.{leaf}"] = value
    return out


def _notes(exc: BaseException) -> str:
    """The notes on ``exc`` (runconfig/ioretry.py's "gave up after N attempt(s) ..."), each in parentheses."""
    return "".join(f" ({note})" for note in getattr(exc, "__notes__", []))


def _read_failed(exc: OSError, what: str) -> tuple[int | None, str]:
    """(errno, message) of a restore read that failed for good: the errno of a transient error (a crash,
    restarted), None for any other (bad input); the message names ``what`` and keeps the retries' notes."""
    return io_errno(exc) if is_transient(exc) else None, f"reading {what} failed: {exc}{_notes(exc)}"


def _raise_crash(crash: tuple[int | None, str] | None) -> None:
    """Raise, on every rank, a restore read that failed for good (``_read_failed``): GaveUp or UserError."""
    if crash:
        raise GaveUp(*crash) if crash[0] is not None else UserError(crash[1], collective=True)


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


def _origin(exc: BaseException, rank: int) -> tuple[int, BaseException]:
    """(the rank it happened on, the error behind it): DCP wraps each rank's exception in CheckpointException,
    which every rank raises; the OSError behind a wrapper where there is one."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (exc, _) = min(exc.failures.items(), key=lambda kv: kv[0])
    while not isinstance(exc, OSError) and (exc.__cause__ or exc.__context__):
        exc = exc.__cause__ or exc.__context__
    return rank, exc


def _root_cause(exc: BaseException) -> str:
    """One line for the error behind a failed save or load."""
    _, exc = _origin(exc, 0)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f" ({exc.filename})" if exc.filename else "")
    return (f"{type(exc).__name__}: {exc}").splitlines()[0][:300]
