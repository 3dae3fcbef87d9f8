"""Saving and restoring training state as atomic checkpoint generations (layout: runconfig/checkpoints.py).

Model and optimizer go through torch.distributed.checkpoint (DCP), so a run with another number of ranks can
load them; each rank adds its RNG states (``rank_NNNNN.pt``, loaded with ``weights_only=True``) and rank 0 the
loop state (``train_state.json``). Rank 0 commits: per-file SHA-256 into ``manifest.json``, fsync, rename,
``latest``, then prunes old generations. With ``async_save`` the state is first copied to CPU memory and a
background thread writes and commits it while training goes on, on a process group of its own.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mpi4py import MPI
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from runconfig import RunConfig, RunDir
from runconfig.checkpoints import (
    TMP_PREFIX,
    CheckpointInvalid,
    commit,
    fsync_path,
    newest_valid,
    prune,
    remove_stale_tmp,
    sha256_file,
    step_name,
)
from runconfig.load import config_hash
from trainer.checkpoint.fingerprint import params_sha256, tensors_sha256
from trainer.checkpoint.provenance import git_commit, versions
from trainer.checkpoint.state import TrainState, rank_seed
from trainer.env import RuntimeEnv
from trainer.errors import UserError

log = logging.getLogger(__name__)
FORMAT = 2  # 2: the recipe, its architecture and the parameter shapes identify the model (1: the GPT's config)


class CheckpointError(UserError):
    """A checkpoint could not be written; the previous generation is untouched."""


def rng_state() -> dict:
    key, pos, has_gauss, cached = np.random.get_state(legacy=True)[1:]
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "cached": cached},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _stage(obj, buf):
    """Copy a (nested) state dict into CPU buffers, reusing ``buf`` from the previous save where shapes match.

    Reuse is safe because a save starts only after the previous one is committed; copying into warm buffers is
    several times faster than allocating fresh ones.
    """
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


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


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
    ) -> None:
        """``model`` is the bare module (parameter names without DDP's "module."); ``architecture`` the recipe's
        settings that define the model beyond its shapes; ``code_sha256`` the recipe's code snapshot."""
        self.cfg, self.env, self.comm = cfg, env, comm
        self.model, self.optimizer = model, optimizer
        self.identity = {
            "recipe": cfg.recipe,
            "architecture": dict(architecture or {}),
            "param_shapes": {n: [*p.shape, str(p.dtype)] for n, p in model.named_parameters()},
        }
        self.code_sha256 = code_sha256
        self.root = rundir.checkpoints
        self.ccfg = cfg.checkpoint
        # Its own group, so a background save never interleaves with the training collectives.
        self.group = dist.new_group(backend="gloo")
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt") if self.ccfg.async_save else None
        self.pending: Future | None = None
        self.param_names = [name for name, _ in model.named_parameters()]
        self._staging: dict | None = None  # CPU buffers reused by async saves
        self.last_commit_time = time.monotonic()
        self.blocking_s: list[float] = []  # time the training loop waited per save
        self.verified: set[str] = set()  # generations this process committed or fully verified (rank 0)

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
        tmp = self.root / f"{TMP_PREFIX}{name}"
        error = None
        if self.env.rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(mode=0o700, parents=True)
            except OSError as exc:
                error = f"cannot create {tmp}: {exc.strerror or exc}"
        self._agree(error, state.step)
        error = None
        try:
            path = tmp / f"rank_{self.env.rank:05d}.pt"
            torch.save({"rng": rng_state()}, path)
            _fsync_file(path)
            if self.env.rank == 0:
                path = tmp / "train_state.json"
                path.write_text(json.dumps(state.state_dict(), indent=2) + "\n")
                _fsync_file(path)
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
            error = f"cannot write {path}: {_root_cause(exc)}{_space_note(tmp)}"
        self._agree(error, state.step, tmp)
        msd, osd = get_state_dict(self.model, self.optimizer)
        meta = self._manifest(state)
        if self.pool is None:
            self._write_and_commit({"model": msd, "optim": osd}, tmp, name, meta, state.step)
        else:
            staged = self._staging = _stage({"model": msd, "optim": osd}, self._staging)
            if any(t.is_cuda for t in msd.values() if isinstance(t, torch.Tensor)):
                torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
            self.pending = self.pool.submit(self._write_and_commit, staged, tmp, name, meta, state.step)
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

    def _write_and_commit(self, state_dict: dict, tmp: Path, name: str, meta: dict, step: int) -> None:
        meta = {**meta, "params_sha256": tensors_sha256((n, state_dict["model"][n]) for n in self.param_names)}
        error = None
        try:
            dcp.save(
                state_dict, storage_writer=dcp.FileSystemWriter(tmp / "dcp", sync_files=True), process_group=self.group
            )
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException wrapping per-rank errors
            error = f"writing the model and optimizer state failed: {_root_cause(exc)}{_space_note(tmp)}"
        self._agree(error, step, tmp)
        if self.env.rank == 0:
            try:
                files = {}
                for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                    files[path.relative_to(tmp).as_posix()] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
                fsync_all_dirs(tmp)
                commit(tmp, self.root / name, {**meta, "files": files, "committed_at": time.time()})
            except OSError as exc:
                error = f"committing {self.root / name} failed: {exc.strerror or exc}"
        self._agree(error, step, tmp)
        self.last_commit_time = time.monotonic()
        if self.env.rank == 0:
            self.verified.add(name)
            removed = prune(
                self.root, keep_last=self.ccfg.keep_last, keep_every=self.ccfg.keep_every, verified=self.verified
            )
            log.info("checkpoint %s committed%s", name, f"; pruned {[p.name for p in removed]}" if removed else "")

    def _agree(self, error: str | None, step: int, tmp: Path | None = None) -> None:
        """Every rank learns whether any rank failed, on the checkpoint group (safe from the background thread)."""
        errors: list[str | None] = [None] * self.env.world_size
        dist.all_gather_object(errors, error, group=self.group)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if not failed:
            return
        if tmp is not None and self.env.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # never committed: free the space it took
        rank, message = failed[0]
        raise CheckpointError(
            f"rank {rank}: checkpoint at step {step} could not be saved: {message}. The previous checkpoint, if "
            f"any, is intact in {self.root}.",
            collective=True,
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

        Returns False when the run directory has no checkpoint yet.
        """
        found = error = None
        warnings: list[str] = []
        if self.env.rank == 0:
            try:
                remove_stale_tmp(self.root)
                hit = newest_valid(self.root, warnings.append)
                found = str(hit[0]) if hit else None
                if hit:
                    self.verified.add(hit[0].name)
            except (CheckpointInvalid, OSError) as exc:
                error = str(exc)
        found, error, warnings = self.comm.bcast((found, error, warnings), root=0)
        for w in warnings:
            if self.env.rank == 0:
                log.warning(w)
        if error:
            raise UserError(error, collective=True)
        if found is None:
            return False
        path = Path(found)
        manifest = json.loads((path / "manifest.json").read_text())
        if self.env.rank == 0:
            log.info("restoring %s (step %d)", path.name, manifest["step"])
        changed = self._check_compatible(manifest, path)
        if changed:
            self._warm_start(path, changed)
        else:
            msd, osd = get_state_dict(self.model, self.optimizer)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=path / "dcp", process_group=self.group)
            set_state_dict(self.model, self.optimizer, model_state_dict=msd, optim_state_dict=osd)
            if params_sha256(self.model) != manifest["params_sha256"]:
                raise UserError(
                    f"checkpoint {path}: the loaded parameters do not match the manifest's params_sha256.",
                    collective=True,
                )
        state.load_state_dict(json.loads((path / "train_state.json").read_text()))
        if manifest["world_size"] == self.env.world_size:
            rank_file = path / f"rank_{self.env.rank:05d}.pt"
            set_rng_state(torch.load(rank_file, weights_only=True)["rng"])
        else:  # per-rank streams cannot be mapped to another world size: derive fresh ones deterministically
            seed = rank_seed(self.cfg.train.seed, self.env.rank, state.step)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)
        if self.env.rank == 0:
            log.info("resumed from %s (step %d, saved by %d ranks)", path.name, state.step, manifest["world_size"])
        self.last_commit_time = time.monotonic()
        return True

    def _check_compatible(self, manifest: dict, path: Path) -> dict[str, tuple | str]:
        """What identifies the model and optimizer and differs from the checkpoint's: the recipe, its
        architecture settings, a parameter's name, shape or dtype, the optimizer's type. Refused unless
        allow_shape_change. (Dropout and other settings that change no tensor are not part of it.)"""
        if manifest.get("format") != FORMAT:
            raise UserError(
                f"checkpoint {path} has format {manifest.get('format')}, this trainer reads format {FORMAT}; resume "
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

    def _warm_start(self, path: Path, changed: dict[str, tuple | str]) -> None:
        """Forced resume across a model/optimizer change: load every parameter whose name and shape still match.

        The optimizer state is loaded only when every parameter loaded and the optimizer type is unchanged;
        otherwise it starts fresh (its moments would belong to other tensors).
        """
        model, optimizer = self.model, self.optimizer
        msd, osd = get_state_dict(model, optimizer)
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
        set_model_state_dict(model, fits, options=StateDictOptions(strict=False))
        if with_optim:
            set_optimizer_state_dict(model, optimizer, osd)
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


def _root_cause(exc: BaseException) -> str:
    """One line for the error behind a failed save (DCP wraps each rank's exception in CheckpointException)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    while not isinstance(exc, OSError) and (exc.__cause__ or exc.__context__):
        exc = exc.__cause__ or exc.__context__
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f" ({exc.filename})" if exc.filename else "")
    return (f"{type(exc).__name__}: {exc}").splitlines()[0][:300]
