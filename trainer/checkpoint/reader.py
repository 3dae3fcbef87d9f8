"""Finding, verifying and loading the newest valid generation (layout: rundir/checkpoints.py).

No rank reads the whole generation: rank 0 reads the manifest and checks the sizes, and the files are split over
the ranks by size, each rank hashing its share. A newer generation that does not verify is skipped with a warning
(kept in ``skipped`` for the resume event); when generations exist but none verifies the run stops, deleting
nothing. Reads that fail with a transient storage error are retried (checkpoint.io_retries) and never make a
generation count as invalid.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rundir.checkpoints import CheckpointInvalid, generations, newest_valid, remove_stale_tmp, sha256_file, validate
from storage.ioretry import GaveUp, is_transient
from trainer.checkpoint.agreement import Agreement, Failed, raise_crash, read_failed, root_cause
from trainer.checkpoint.compat import (
    Changes,
    check_compatible,
    optim_key,
    options,
    renamed,
    warm_start,
    with_copies,
    without,
)
from trainer.checkpoint.fingerprint import owners, params_sha256, params_sha256_v1
from trainer.checkpoint.kernels import kernels, restore_kernels
from trainer.checkpoint.rng import seed_rank, set_rng_state
from trainer.checkpoint.state import TrainState
from trainer.errors import UserError
from trainer.parallel.diloco import OuterSync

log = logging.getLogger(__name__)


class GenerationReader:
    """Restores a run's state from the newest generation in ``root`` that verifies. ``identity``: the run's recipe,
    architecture and parameter shapes (compat.check_compatible); ``aliases``: {tied copy: whole-model name}."""

    def __init__(
        self,
        *,
        root: Path,
        agreement: Agreement,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        identity: dict,
        aliases: dict[str, str],
        seed: int,
        allow_shape_change: bool,
        verified: set[str],
        outer: OuterSync | None = None,
        node: int = 0,
    ) -> None:
        self.root, self.agreement = root, agreement
        self.rank, self.world_size = agreement.rank, agreement.world_size
        self.model, self.optimizer, self.identity = model, optimizer, identity
        # tied copies held apart: under the whole model's name on another rank (read under it), or beside it here
        # (twins: their state copied from it after the read)
        local = dict(model.named_parameters(remove_duplicate=False))
        self.twins = {a: w for a, w in aliases.items() if w in local}
        self.apart = {a: w for a, w in aliases.items() if a not in self.twins}
        self.seed, self.allow_shape_change, self.verified = seed, allow_shape_change, verified
        self.skipped: list[str] = []  # rank 0: why newer generations were passed over
        self.outer, self.node = outer, node  # comm.sync rounds: the outer state, this rank's node (its optimizer key)

    def restore(self, state: TrainState, downloaded: str | None = None) -> bool:
        """Load the newest valid generation into the model, optimizer, RNGs and ``state``; False when there is none
        yet. ``downloaded``: a generation every rank just downloaded and hashed its share of (remote.py), not hashed
        again. Collective."""
        found = self.find(downloaded)
        if found is None:
            return False
        self.load(*found, state)
        return True

    def load(self, path: Path, manifest: dict, state: TrainState, *, fingerprint: bool = True) -> None:
        """Load generation ``path`` (its manifest checked) into the model, optimizer, RNGs and ``state``;
        ``fingerprint``: compare the loaded parameters with the manifest's params_sha256 (a generation in node
        memory has none: its files were checked instead). Collective."""
        if self.rank == 0:
            log.info("restoring %s (step %d)", path.name, manifest["step"])
        changed = check_compatible(
            manifest, path, self.identity, self.optimizer, allow_shape_change=self.allow_shape_change
        )
        self.saved_optim = self._saved_optim_key(path, manifest)
        sync = manifest.get("sync") or {}
        self.saved_momentum = bool(sync.get("momentum"))
        # a node's own parameters, saved by streaming rounds, are read back by the same streaming only; otherwise
        # every node goes on from the fragments' last meetings, the checkpoint's model
        fragments = len(self.outer.fragments) if self.outer is not None else 1
        self.saved_local = fragments > 1 and sync.get("fragments", 1) == fragments
        self._load_retrying(path, changed, manifest["format"])
        if fingerprint:
            self._check_fingerprint(path, manifest, changed)
        if self.outer is not None:
            self.outer.resume_local()
        state.load_state_dict(json.loads(self._read(path / "train_state.json")))
        if manifest["world_size"] == self.world_size:
            rank_file = path / f"rank_{self.rank:05d}.pt"
            set_rng_state(torch.load(io.BytesIO(self._read(rank_file)), weights_only=True)["rng"])
        else:  # per-rank streams cannot be mapped to another world size: derive fresh ones deterministically
            seed_rank(self.seed, self.rank, state.step)
        if self.rank == 0:
            log.info("resumed from %s (step %d, saved by %d ranks)", path.name, state.step, manifest["world_size"])

    def find(self, downloaded: str | None = None) -> tuple[Path, dict] | None:
        """The newest generation that validates (``newest_valid``), each rank hashing its share of the files.
        Collective: the list of generations is rank 0's, and ``_check`` gives every rank the same outcome, so every
        rank checks the same generations in the same order."""
        gens = crash = None
        if self.rank == 0:
            try:
                gens = self.agreement.alone(lambda: [str(p) for p in self._generations()], self.root)
            except OSError as exc:
                crash = read_failed(exc, f"the checkpoints in {self.root}")
        gens, crash = self.agreement.from_rank0((gens, crash))  # rank 0 listed them alone
        raise_crash(crash)
        try:
            found = newest_valid(self.root, self.warn, paths=[Path(p) for p in gens],
                                 check=lambda p: self._check(p, hashes=p.name != downloaded))  # fmt: skip
        except CheckpointInvalid as exc:
            raise UserError(str(exc), collective=True) from None
        if found is not None and self.rank == 0:
            self.verified.add(found[0].name)
        return found

    def warn(self, message: str) -> None:
        """Rank 0: a generation passed over, logged and kept for the resume event."""
        if self.rank == 0:
            log.warning("%s", message)
            self.skipped.append(message)

    def _generations(self) -> list[Path]:
        """Rank 0: the generations, oldest first, after removing the partial writes of a crashed save."""
        remove_stale_tmp(self.root)
        return [p for _, p in generations(self.root)]

    def _check(self, path: Path, *, hashes: bool = True) -> dict:
        """The manifest of generation ``path`` if it is valid. Every rank returns the same manifest or raises the
        same error: CheckpointInvalid naming the file at fault; GaveUp (a transient error that outlived the
        retries) or UserError (an unreadable file). Collective."""
        manifest = problem = crash = None
        if self.rank == 0:
            try:
                manifest = self.agreement.alone(lambda: validate(path, verify_hashes=False), path)
            except CheckpointInvalid as exc:
                problem = str(exc)
            except OSError as exc:
                crash = read_failed(exc, str(path))
        manifest, problem, crash = self.agreement.from_rank0((manifest, problem, crash))  # rank 0 read it alone
        if not crash and not problem and hashes:
            reports = self.agreement.gather(self._verify_share(path, manifest["files"]))  # shares differ
            crash = next((c for _, c in reports if c), None)
            problem = next((p for p, _ in reports if p), None)
        raise_crash(crash)
        if problem:
            raise CheckpointInvalid(problem)
        return manifest

    def _verify_share(self, path: Path, files: dict) -> tuple[str | None, tuple | None]:
        """(problem, crash) of this rank's share of the generation's files: a digest that differs, a file that
        cannot be read; crash: (errno, message) of a transient error that outlived the retries."""
        sizes = {rel: int(meta["size"]) for rel, meta in files.items()}
        for rel in shares(sizes, self.world_size)[self.rank]:
            fpath = path / rel
            try:
                if self.agreement.alone(lambda f=fpath: sha256_file(f), fpath) != files[rel]["sha256"]:
                    return f"{fpath} does not match its SHA-256 in the manifest (corrupt)", None
            except OSError as exc:
                if is_transient(exc):
                    return None, read_failed(exc, str(fpath))
                return f"{fpath} cannot be read ({exc.strerror or exc})", None
        return None, None

    def _read(self, path: Path) -> bytes:
        return self.agreement.alone(path.read_bytes, path)

    def _load_retrying(self, path: Path, changed: Changes, fmt: int) -> None:
        """The model and optimizer state through DCP, retried as a unit after transient errors. Collective."""
        try:
            self.agreement.retrying(
                f"loading checkpoint {path.name}", lambda began: self._load(path, changed, fmt, began)
            )
        except Failed as failed:
            first = failed.reports[0]
            message = f"rank {first['rank']}: loading checkpoint {path} failed: {first['message']}"
            if failed.transient:
                raise GaveUp(first["errno"], f"{message}{self.agreement.gave_up_after(failed)}") from failed.cause
            raise RuntimeError(message) from failed.cause

    def _load(self, path: Path, changed: Changes, fmt: int, began: float) -> None:
        """One attempt at loading the model and optimizer state. Collective."""
        error = None
        kept = kernels(self.optimizer)  # the run's own kernel choice, which the load overwrites (kernels.py)
        group = self.agreement.group
        try:
            if changed:
                warm_start(path, changed, fmt, self.model, self.optimizer, group=group, rank=self.rank)
                if self.outer is not None:  # the rounds' last meeting is the warm-started model, no momentum
                    self.outer.load_state_dict({}, has_momentum=False)
            else:
                msd, osd = get_state_dict(self.model, self.optimizer, options=options(fmt))
                osd = without(renamed(osd, self.apart), self.twins)
                state = {"model": msd, self.saved_optim: osd}
                rounds = {}
                if self.outer is not None:  # saved by comm.sync rounds: the outer momentum, a node's parameters
                    rounds = self.outer.template(self.node, momentum=self.saved_momentum, local=self.saved_local)
                dcp.load(state | rounds, checkpoint_id=path / "dcp", process_group=group)
                osd = with_copies(renamed(osd, {whole: alias for alias, whole in self.apart.items()}), self.twins)
                set_state_dict(
                    self.model, self.optimizer, model_state_dict=msd, optim_state_dict=osd, options=options(fmt)
                )
                if self.outer is not None:
                    self.outer.load(rounds, self.node)
        except (Exception, CheckpointException) as exc:
            error = (exc, f"reading {path / 'dcp'}: {root_cause(exc)}")
        differed = restore_kernels(self.optimizer, kept)
        if differed and self.rank == 0 and error is None:
            log.info(
                "optimizer kernels: %s saved them otherwise (%s); this run's are kept (train.optimizer_impl, or the "
                "recipe's own optimizer): the moments and hyperparameters load as saved, the last bits of later steps "
                "may differ from a run that kept the saved kernels",
                path.name,
                ", ".join(differed),
            )
        self.agreement.agree(error, began)

    def _saved_optim_key(self, path: Path, manifest: dict) -> str:
        """The DCP key this rank's optimizer state was saved under: "optim", or with comm.sync rounds its node's (a
        run that had rounds and now has none takes node 0's; one that now has rounds from a checkpoint without
        them starts every node from the one saved state)."""
        sync = manifest.get("sync")
        if not sync:
            return "optim"
        if self.outer is None:
            return optim_key(0)
        nodes = self.outer.groups.num_nodes
        if int(sync["nodes"]) != nodes:
            raise UserError(
                f"checkpoint {path} was saved by comm.sync={sync['kind']} rounds of {sync['nodes']} nodes, each with "
                f"its own optimizer state; this launch has {nodes} nodes. Resume it on {sync['nodes']} nodes (or "
                "with comm.sync=ddp, which takes node 0's optimizer state).",
                collective=True,
            )
        return optim_key(self.node)

    def _check_fingerprint(self, path: Path, manifest: dict, changed: Changes) -> None:
        """The loaded parameters are the ones saved (not after a warm start, which loads only some)."""
        if changed:
            return
        if manifest.get("format", 1) >= 3:
            loaded = params_sha256(self.model, skip={**self.apart, **self.twins})
        else:  # an older manifest: its fingerprint covers every byte in one hash
            loaded = params_sha256_v1(self.model.named_parameters())
        if loaded != manifest["params_sha256"]:
            raise UserError(
                f"checkpoint {path}: the loaded parameters do not match the manifest's params_sha256.",
                collective=True,
            )


def shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """The files each rank verifies at restore: largest first to the least-loaded rank (deterministic)."""
    names = sorted(sizes)
    out: list[list[str]] = [[] for _ in range(world)]
    for name, rank in zip(names, owners([sizes[n] for n in names], world), strict=True):
        out[rank].append(name)
    return out
