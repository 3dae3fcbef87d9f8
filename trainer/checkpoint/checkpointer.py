"""Saving and restoring training state as atomic checkpoint generations: the one object the loop and the build
use, over the parts that do each job (layout: rundir/checkpoints.py).

- when to save: ``due_by_steps``, ``due_by_time`` (checkpoint.every_steps, every_minutes, at_end);
- writing, committing and pruning: ``writer.py`` (with ``async_save``, from a background thread on CPU copies);
- finding, verifying and loading: ``reader.py``; whether a checkpoint fits the run: ``compat.py``;
- how the ranks agree on every phase, with retries of transient storage errors: ``agreement.py``;
- what a manifest records: ``provenance.py``; the random streams: ``rng.py``; the fingerprint: ``fingerprint.py``.

Model and optimizer go through torch.distributed.checkpoint (DCP), so a run with another number of ranks can load
them; each rank adds its RNG states (``rank_NNNNN.pt``, loaded with ``weights_only=True``) and rank 0 the loop
state (``train_state.json``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from runconfig import RunConfig
from rundir import RunDir
from rundir.checkpoints import NO_BEST, Best, generations, step_name
from rundir.identity import ensure_identity
from storage.ioretry import BUDGET_S, RetryPolicy
from storage.objstore import Store
from trainer.checkpoint.agreement import Agreement, Failed
from trainer.checkpoint.compat import FORMAT, optim_key, options
from trainer.checkpoint.fingerprint import params_sha256
from trainer.checkpoint.memory import MemoryCheckpoints
from trainer.checkpoint.provenance import manifest_fields
from trainer.checkpoint.reader import GenerationReader
from trainer.checkpoint.remote import RemoteGenerations
from trainer.checkpoint.rng import rng_state
from trainer.checkpoint.state import TrainState
from trainer.checkpoint.writer import CheckpointError, GenerationWriter, json_bytes, stage, torch_bytes
from trainer.env import RuntimeEnv
from trainer.observe.inject import Injector
from trainer.parallel.diloco import OuterSync

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "Checkpointer"]


class Checkpointer:
    def __init__(
        self,
        *,
        cfg: RunConfig,
        env: RuntimeEnv,
        rundir: RunDir,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        architecture: dict | None = None,
        code_sha256: str | None = None,
        injector: Injector | None = None,
        param_shapes: dict | None = None,
        aliases: dict[str, str] | None = None,
        outer: OuterSync | None = None,
    ) -> None:
        """``model`` is the bare module (parameter names without DDP's "module."; under pipeline parallelism this
        rank's stage); ``architecture`` the recipe's settings that define the model beyond its shapes;
        ``code_sha256`` the recipe's code snapshot; ``injector`` the faults injected by tests (``eio_save``);
        ``param_shapes`` the whole model's {name: [*shape, dtype]} (default: ``model``'s); ``aliases`` {name of a
        tied copy: the whole model's name} (a pipeline's output head tied to the first stage's embedding): left out
        of ``params_sha256``, its optimizer state read under the whole model's name; ``outer``: the rounds of
        comm.sync (trainer/parallel/diloco.py). The ranks agree through torch.distributed (agreement.py)."""
        self.cfg, self.env, self.ccfg = cfg, env, cfg.checkpoint
        self.model, self.optimizer, self.code_sha256 = model, optimizer, code_sha256
        # comm.sync=diloco or local_sgd: each node's optimizer state is its own (a key per node), and the outer
        # optimizer's momentum is saved beside them
        self.outer = outer
        self.optim_key = optim_key(env.node if outer is not None else None)
        self.root = rundir.checkpoints
        # Rank 0 names and authenticates the generations (rundir/identity.py); a run directory older than identities
        # gets one now.
        self.run = ensure_identity(rundir.identity) if env.rank == 0 else None
        self.rundir = rundir
        self.identity = {
            "recipe": cfg.recipe,
            "architecture": dict(architecture or {}),
            "param_shapes": param_shapes or {n: [*p.shape, str(p.dtype)] for n, p in model.named_parameters()},
        }
        local = dict(model.named_parameters(remove_duplicate=False))
        # The tied copies this rank holds apart from their whole-model name's parameter: a pipeline's last stage's
        # head, and a V placement's head beside its own embedding (each stage its own copy: pipeline.untie).
        self.aliases = {a: w for a, w in (aliases or {}).items() if a in local and local.get(w) is not local[a]}
        self.agreement = self._agreement()
        self.remote = self._remote(injector)
        verified: set[str] = set()  # generations this process committed or fully verified (rank 0)
        self.writer = self._writer(aliases or {}, verified, injector)
        self.reader = self._reader(verified)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt") if self.ccfg.async_save else None
        self.pending: Future | None = None
        self.sharded = any(isinstance(p, DTensor) for p in model.parameters())
        self._staging: dict | None = None  # CPU buffers reused by async saves
        self.last_commit_time = time.monotonic()
        self.blocking_s: list[float] = []  # time the training loop waited per save
        self.last_save_s: float | None = None  # the newest committed save's seconds, save() -> committed
        self.on_commit: Callable[[int], None] | None = None  # told each committed step (rank 0's tracker)
        self.tracking_run: Callable[[], str | None] | None = None  # the tracker run's id, in the manifest
        self.memory_pool: ThreadPoolExecutor | None = None  # checkpoint.memory_every_steps with async_save
        self.memory_pending: Future | None = None
        self._memory_staging: dict | None = None  # CPU buffers reused by background memory saves
        self.memory = self._memory()
        self.restored_from: dict | None = None  # where the last restore came from and why (the resume event)

    # -- build --------------------------------------------------------------------------------------------
    def _agreement(self) -> Agreement:
        """How the ranks agree on every phase. Collective: may create a process group."""
        # Retries end well within the collective timeout: the other ranks wait in one while a rank retries alone.
        policy = RetryPolicy(
            self.ccfg.io_retries,
            self.ccfg.io_retry_backoff_s,
            "checkpoint.io_retries",
            budget_s=min(BUDGET_S, self.cfg.comm.timeout_s / 2),
        )
        # A gloo group of its own where a save may run beside the training collectives (in the background) or
        # where those run on NCCL (the checkpoint's objects are CPU objects); else the default gloo group: every
        # further gloo group keeps a polling thread (docs/measurements/notes-trainer.md).
        own = self.ccfg.async_save or dist.get_backend() != "gloo"
        group = dist.new_group(backend="gloo") if own else None
        return Agreement(self.env.rank, self.env.world_size, group, policy)

    def _remote(self, injector: Injector | None) -> RemoteGenerations | None:
        """checkpoint.storage: every generation also uploaded there (remote.py); the local copies are the staging."""
        if not self.ccfg.storage:
            return None
        return RemoteGenerations(
            store=Store(self.cfg.storage), url=self.ccfg.storage, agreement=self.agreement, root=self.root,
            keep_last=self.ccfg.keep_last, keep_every=self.ccfg.keep_every, identity=self.run, run_dir=self.rundir.root,
            best=self._best(),
            before_upload=injector.before_upload if injector and injector.injects("slow_upload") else None,
        )  # fmt: skip

    def _writer(self, aliases: dict[str, str], verified: set[str], injector: Injector | None) -> GenerationWriter:
        return GenerationWriter(
            root=self.root,
            agreement=self.agreement,
            keep_last=self.ccfg.keep_local if self.remote else self.ccfg.keep_last,
            keep_every=self.ccfg.keep_every,
            param_names=[name for name, _ in self.model.named_parameters() if name not in aliases],
            verified=verified,
            identity=self.run,
            injector=injector,
            best=NO_BEST if self.remote else self._best(),  # with checkpoint.storage the bucket keeps the best
        )

    def _memory(self) -> MemoryCheckpoints | None:
        """checkpoint.memory_every_steps: generations in node memory (memory.py). With checkpoint.async_save they are
        written from a background thread of their own, on a gloo group of their own, while training goes on; else
        by the loop's thread, on the default group over gloo. Collective."""
        if not self.ccfg.memory_every_steps:
            return None
        background = self.ccfg.async_save
        if background:
            self.memory_pool = ThreadPoolExecutor(1, thread_name_prefix="memckpt")
        own = background or dist.get_backend() != "gloo"
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.cfg.comm.timeout_s)) if own else None
        agreement = Agreement(self.env.rank, self.env.world_size, group, self.agreement.policy)
        return MemoryCheckpoints(memory_dir=self.ccfg.memory_dir, every=self.ccfg.memory_every_steps, env=self.env,
                                 agreement=agreement, identity=self.run)  # fmt: skip

    def _best(self) -> Best:
        return Best(self.ccfg.keep_best, self.ccfg.best_metric, self.ccfg.best_mode)

    def _reader(self, verified: set[str]) -> GenerationReader:
        return GenerationReader(
            root=self.root,
            agreement=self.agreement,
            model=self.model,
            optimizer=self.optimizer,
            identity=self.identity,
            aliases=self.aliases,
            seed=self.cfg.train.seed,
            allow_shape_change=self.ccfg.allow_shape_change,
            verified=verified,
            outer=self.outer,
            node=self.env.node,
        )

    @property
    def skipped(self) -> list[str]:
        """Rank 0: why the last restore passed over newer generations (damaged ones), for the resume event."""
        return self.reader.skipped

    # -- when ---------------------------------------------------------------------------------------------
    def due_by_steps(self, step: int, final: bool) -> bool:
        every = self.ccfg.every_steps
        return bool(every and step % every == 0) or (final and self.ccfg.at_end)

    def due_by_time(self) -> bool:
        """Rank 0's clock decides; the loop shares this flag with the other ranks in its step collective."""
        minutes = self.ccfg.every_minutes
        return bool(minutes) and time.monotonic() - self.last_commit_time >= 60 * minutes

    def _state(self) -> dict:
        """What DCP saves: the model, this rank's optimizer state (under its node's key with comm.sync rounds) and
        the rounds' own entries (the outer momentum; streaming: the node's own parameters)."""
        msd, osd = get_state_dict(self.model, self.optimizer, options=options())
        state = {"model": msd, self.optim_key: osd}
        if self.outer is not None:
            state |= self.outer.checkpoint(msd, self.env.node)
        return state

    def _own_files(self, state: TrainState) -> dict[str, bytes]:
        """This rank's files of a generation besides DCP's: its RNG streams, and rank 0's loop state."""
        files = {f"rank_{self.env.rank:05d}.pt": torch_bytes({"rng": rng_state()})}
        if self.env.rank == 0:
            files["train_state.json"] = json_bytes(state.state_dict())
        return files

    def memory_due(self, step: int) -> bool:
        return self.memory is not None and self.memory.due(step)

    # -- save ---------------------------------------------------------------------------------------------
    def save_memory(self, state: TrainState) -> None:
        """Write the state for ``state.step`` into node memory and onto the partner nodes; with checkpoint.async_save
        from CPU buffers in the background, after the previous one is done (the loop waits for it here). A failure
        is logged: the durable checkpoints go on. Collective."""
        assert self.memory is not None
        self.wait_memory()
        files = self._own_files(state)
        full = self._state()
        fields = self._fields(state)
        if self.memory_pool is None:
            self.memory.save(state.step, full, files, fields)
        else:
            staged = self._memory_staging = stage(full, self._memory_staging)
            if any(t.is_cuda for t in full["model"].values() if isinstance(t, torch.Tensor)):
                torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
            self.memory_pending = self.memory_pool.submit(self.memory.save, state.step, staged, files, fields)

    def wait_memory(self) -> bool | None:
        """Wait for the save in node memory in flight, if any; whether it was committed (None: none in flight)."""
        pending = self.memory_pending
        if pending is None:
            return None
        self.memory_pending = None
        return pending.result()

    def _fields(self, state: TrainState) -> dict:
        sync = None
        if self.outer is not None:  # a resume needs as many nodes: a node's optimizer state is its own
            sync = {"kind": self.outer.kind, "every": self.outer.every, "nodes": self.env.topology.num_nodes,
                    "momentum": self.outer.has_momentum, "fragments": len(self.outer.fragments)}  # fmt: skip
        return {"sync": sync} | manifest_fields(
            cfg=self.cfg,
            env=self.env,
            state=state,
            identity=self.identity,
            code_sha256=self.code_sha256,
            optimizer_type=type(self.optimizer).__name__,
            fmt=FORMAT,
        )

    def save(self, state: TrainState, *, block: bool) -> None:
        """Write the generation for ``state.step``. Blocks for the CPU copy only (async), or until committed."""
        start = time.perf_counter()
        self.wait()  # never two writes at once
        name = step_name(state.step)
        # This rank's own files, serialised now: every attempt of the save (in the background with async_save)
        # writes these same bytes, whatever the loop has done since.
        files = self._own_files(state)
        full = self._state()
        meta = self._fields(state)
        if self.tracking_run is not None:
            meta["tracking_run_id"] = self.tracking_run()
        if self.sharded:  # gathering whole parameters is collective: here, not in a background save's thread
            meta["params_sha256"] = params_sha256(self.model, skip=self.aliases)
        if self.pool is None:
            self._write_and_commit(full, files, name, meta, state.step, start)
        else:
            staged = self._staging = stage(full, self._staging)
            if any(t.is_cuda for t in full["model"].values() if isinstance(t, torch.Tensor)):
                torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
            self.pending = self.pool.submit(self._write_and_commit, staged, files, name, meta, state.step, start)
            if block:
                self.wait()
        self.blocking_s.append(time.perf_counter() - start)

    def _write_and_commit(
        self, state_dict: dict, files: dict[str, bytes], name: str, meta: dict, step: int, start: float
    ) -> None:
        self.writer.write_and_commit(state_dict, files, name, meta, step)
        if self.remote is not None:
            try:
                self.remote.upload(self.root / name, step)
            except Failed as failed:  # the local generation stays committed; the bucket's newest is the previous
                raise self.writer.save_failed(failed, step) from failed.cause
        self.last_commit_time = time.monotonic()
        self.last_save_s = time.perf_counter() - start
        self.writer.after_commit(name)
        if self.on_commit is not None:
            self.on_commit(step)
        if self.remote is not None and self.env.rank == 0:
            pruned = self.remote.prune()
            if pruned:
                log.info("pruned %s from %s", pruned, self.ccfg.storage)

    def wait(self) -> None:
        """Wait for a background save to be committed (re-raising its error)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
            self.wait_memory()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
            if self.memory_pool is not None:
                self.memory_pool.shutdown(wait=True)

    # -- restore ------------------------------------------------------------------------------------------
    def restore(self, state: TrainState) -> bool:
        """Load the newest valid generation into the model, optimizer, RNGs and ``state``; False when the run
        directory has no checkpoint yet. Collective."""
        self.reader.skipped = []
        self.restored_from = None
        self.partly_loaded = False
        if self.memory is not None and self._restore_from_memory(state):
            self.last_commit_time = time.monotonic()
            return True
        downloaded = self.remote.fetch_newest(self.reader.warn) if self.remote is not None else None
        restored = self.reader.restore(state, downloaded)
        if not restored and self.partly_loaded:
            raise RuntimeError(
                f"{self.restored_from['memory']}, after part of it was loaded, and {self.root} holds no durable "
                "checkpoint to restore instead: this launch cannot start afresh from a half-loaded model (a restart "
                "of the launch builds the model anew)"
            )
        if restored:
            self.last_commit_time = time.monotonic()
        return restored

    def _restore_from_memory(self, state: TrainState) -> bool:
        """The newest generation in node memory when it is at least as new as the newest durable one and some node
        holds each of its files; whether it was loaded (else ``restored_from`` says why not). Collective."""
        memory = self.memory
        assert memory is not None
        durable = None
        if self.env.rank == 0:
            try:
                found = generations(self.root)
                durable = found[-1][0] if found else None
            except OSError:
                durable = None
        durable = memory.agreement.from_rank0(durable)
        choice = memory.choose(durable, _comparable(self._fields(TrainState())))
        if choice.step is None:
            self.restored_from = {"from": "durable", "memory": choice.why}
            return False
        try:
            path, fetched = memory.fetch(choice)  # raises on every rank or on none
        except OSError as exc:
            return self._memory_failed(choice.step, str(exc), loaded=False)
        error = None
        try:
            self.reader.load(path, choice.manifest, state, fingerprint=False)
        except Exception as exc:  # noqa: BLE001 - collective parts fail on every rank; a rank's own reads alone
            error = f"rank {self.env.rank}: {exc}"
        errors = [e for e in memory.agreement.gather(error) if e]
        if errors:
            return self._memory_failed(choice.step, errors[0], loaded=True)
        self.restored_from = {"from": "memory", "step": choice.step, "durable_step": durable, "files_fetched": fetched}
        if self.env.rank == 0:
            log.info("resumed from node memory at step %d (%d file(s) fetched from other nodes; durable: %s)",
                     choice.step, fetched, durable)  # fmt: skip
        return True

    def _memory_failed(self, step: int, why: str, *, loaded: bool) -> bool:
        """A generation in memory that could not be restored: the durable one is restored instead (every rank)."""
        if self.env.rank == 0:
            log.warning("restoring the checkpoint in node memory at step %d failed (%s): restoring the durable "
                        "checkpoint instead", step, why)  # fmt: skip
        self.restored_from = {"from": "durable", "memory": f"restoring step {step} failed: {why}"}
        self.partly_loaded = loaded  # the model may hold part of it: a fresh start is no longer one
        return False

    def remove_memory(self) -> None:
        """The run's generations in node memory removed (the run ended or stopped with a durable checkpoint).
        Collective."""
        if self.memory is not None:
            self.memory.remove()


MATCHED = ("format", "config_sha256", "code_sha256", "recipe", "architecture", "param_shapes", "optimizer")


def _comparable(fields: dict) -> dict:
    """The manifest fields a generation in node memory must share with this run, as its manifest.json reads back."""
    return json.loads(json.dumps({k: fields.get(k) for k in MATCHED}))
