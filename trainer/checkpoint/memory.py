"""Checkpoints in node memory, each rank's files copied to a partner on the next node (checkpoint.memory_every_steps).

A generation is the durable one's layout (``dcp/``, ``rank_NNNNN.pt``, ``train_state.json``, ``manifest.json``) in
each node's private folder ``MEMORY_DIR/hpc-UID/RUN_ID/NODE/step_N``: the node's own ranks' files, its partner
ranks' copies, and DCP's ``.metadata`` and the loop state, which every node gets. The partner of a rank is the rank
of the same local index on the next node, so every file is on two nodes (a one-node run has no second copy).

A restore (collective) takes the newest generation whose every file some node of this launch still holds, when it
is at least as new as the newest durable one: the node leaders report what their folders hold, each missing file is
sent by a holder to every node that lacks it (a node that replaced a lost one gets all of them), checked against
the manifest's SHA-256, and DCP loads from the node's own folder, resharding as a durable restore does. Only this
user's folders are read; rank 0 checks the manifest's seal (rundir/identity.py) and that the generation was written
by this config and code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from rundir.checkpoints import generations, step_name
from rundir.identity import RunIdentity, manifest_problem, seal_manifest
from storage.nodememory import node_label, run_folder
from storage.private import UnsafeFolder, private_dir
from trainer.checkpoint.agreement import Agreement
from trainer.checkpoint.writer import hash_files, own_files
from trainer.env import RuntimeEnv
from trainer.observe.memory import nbytes

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TMP = ".tmp-"
KEEP = 2  # committed generations kept per node: the newest and the one before (a commit cut short on one node)
SHARED = ("dcp/.metadata", "train_state.json")  # rank 0's files that every node gets


@dataclass(frozen=True)
class Choice:
    """The generation a restore takes from memory, or why none."""

    step: int | None
    manifest: dict | None = None
    why: str = ""


class MemoryCheckpoints:
    """This rank's side of the node-memory generations. Collective methods run on every rank of ``agreement``."""

    def __init__(self, *, memory_dir: str, every: int, env: RuntimeEnv, agreement: Agreement, identity) -> None:
        """``identity``: rank 0's RunIdentity (its run id names the folder, its key seals the manifests)."""
        self.every, self.env, self.agreement = every, env, agreement
        self.identity: RunIdentity | None = identity
        self.group = agreement.group
        run_id = agreement.from_rank0(identity.run_id if identity is not None else None)
        topo = env.topology
        self.node_index = topo.node_of(env.rank)
        self.leader = topo.node_ranks(self.node_index)[0] == env.rank
        self.leaders = [topo.node_ranks(n)[0] for n in range(topo.num_nodes)]
        self.run_root = run_folder(memory_dir, run_id)
        self.node = self.run_root / node_label(env.node_names[env.rank])
        problem = None
        if self.leader:
            try:
                private_dir(self.node, what="checkpoint.memory_dir folder")
            except (UnsafeFolder, OSError) as exc:
                problem = f"rank {env.rank} ({env.node_names[env.rank]}): {exc}"
        problems = [p for p in agreement.gather(problem) if p]
        self.enabled = not problems
        if problems and env.rank == 0:
            log.warning("checkpoints in node memory are off for this launch: %s", problems[0])
        self.warned_space = False
        self.planner = _Planner(enable_plan_caching=True)

    # -- save ---------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.enabled and bool(self.every) and step % self.every == 0

    def save(self, step: int, state_dict: dict, files: dict[str, bytes], meta: dict) -> bool:
        """Write generation ``step`` on every node and its copies on the partners; whether it was committed.
        ``files``: this rank's own files (rank 0's include train_state.json); ``meta``: the manifest's fields.
        Collective. A failure is logged and skips the generation: the durable checkpoints still hold the run."""
        name = step_name(step)
        tmp = self.node / f"{TMP}{name}"
        fits = self._fits(state_dict)
        if not self._all(fits):
            if self.env.rank == 0 and not self.warned_space:
                log.warning("a checkpoint in node memory would fill more than half of %s's free space on some node: "
                            "none written (durable checkpoints go on)", self.run_root.parent.parent)  # fmt: skip
                self.warned_space = True
            return False
        ok = True
        if self.leader:
            try:
                private_dir(self.node, what="checkpoint.memory_dir folder")  # still this user's own
                for stale in self.node.glob(f"{TMP}*"):  # a partial generation of a save cut short
                    shutil.rmtree(stale)
                tmp.mkdir(mode=0o700)
                (tmp / "dcp").mkdir(mode=0o700)
            except (UnsafeFolder, OSError) as exc:
                log.warning("rank %d: cannot prepare %s: %s", self.env.rank, tmp, exc)
                ok = False
        if not self._all(ok):
            return False
        mine: dict = {}
        try:
            dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(tmp / "dcp", sync_files=False),
                     planner=self.planner, process_group=self.group)  # fmt: skip
            for rel, data in files.items():
                (tmp / rel).write_bytes(data)
            mine = hash_files(tmp, own_files(tmp, self.env.rank))
        except Exception as exc:  # noqa: BLE001 - a memory save never stops the run
            log.warning("rank %d: checkpoint in node memory at step %d not written: %s", self.env.rank, step, exc)
            ok = False
        if not self._all(ok):
            return False
        parts = self.agreement.gather({rel: {**m, "rank": self.env.rank} for rel, m in mine.items()})
        manifest = shared = None
        if self.env.rank == 0:
            body = {**meta, "kind": "memory", "files": {k: v for p in parts for k, v in sorted(p.items())},
                    "committed_at": time.time()}  # fmt: skip
            manifest = seal_manifest(body, self.identity) if self.identity is not None else body
            try:
                shared = {rel: (tmp / rel).read_bytes() for rel in SHARED}
            except OSError as exc:
                log.warning("rank 0: reading %s back failed: %s", tmp, exc)
        manifest, shared = self.agreement.from_rank0((manifest, shared))
        if shared is None:  # rank 0 could not read its shared files back: every rank skips the generation
            return False
        ok = self._replicate(tmp, manifest, shared)
        if not self._all(ok):
            return False
        if self.leader:
            try:
                (tmp / MANIFEST).write_text(json.dumps(manifest))
                final = self.node / name
                if final.exists():
                    shutil.rmtree(final)
                tmp.rename(final)
                self._prune()
            except OSError as exc:
                log.warning("rank %d: committing %s failed: %s", self.env.rank, tmp, exc)
                ok = False
        return self._all(ok)

    def _fits(self, state_dict: dict) -> bool:
        """Whether this node's share of a generation (its ranks' state, twice: own and partner copies; an upper
        bound, DCP writes a replicated tensor once) fits in half of the folder's free space."""
        own = _tensor_bytes(state_dict)
        try:
            free = shutil.disk_usage(self.node).free
        except OSError:
            return False
        return own * len(self.env.topology.node_ranks(self.node_index)) * 2 <= free / 2

    def _partner(self, rank: int) -> int | None:
        """The rank holding ``rank``'s copies: the same local index on the next node (None with one node)."""
        topo = self.env.topology
        if topo.num_nodes < 2:
            return None
        node = (topo.node_of(rank) + 1) % topo.num_nodes
        ranks = topo.node_ranks(node)
        return ranks[topo.local_rank(rank) % len(ranks)]

    def _replicate(self, tmp: Path, manifest: dict, shared: dict[str, bytes]) -> bool:
        """This rank's files to its partner, its partners' files from them, and the shared files on every node.
        Every file is read and written outside the exchange, which every rank enters once they all have their
        files ready: no rank leaves a peer waiting for a message it never posted."""
        by_rank: dict[int, list[str]] = {}
        for rel, meta in manifest["files"].items():
            if rel not in SHARED:
                by_rank.setdefault(int(meta["rank"]), []).append(rel)
        partner = self._partner(self.env.rank)
        outgoing: list[tuple[int, bytes]] = []
        ok = True
        try:
            if self.leader and self.env.rank != 0:
                for rel, data in shared.items():
                    (tmp / rel).write_bytes(data)
            if partner is not None:
                outgoing = [
                    (i, (tmp / rel).read_bytes()) for i, rel in enumerate(sorted(by_rank.get(self.env.rank, [])))
                ]
        except OSError as exc:
            log.warning("rank %d: preparing the copies for the partner node failed: %s", self.env.rank, exc)
            ok = False
        if not self._all(ok):
            return False
        sends = [dist.isend(_as_tensor(data), partner, group=self.group, tag=i) for i, data in outgoing if data]
        recvs = []
        for src in range(self.env.world_size):
            if partner is None or self._partner(src) != self.env.rank:
                continue
            for i, rel in enumerate(sorted(by_rank.get(src, []))):
                size = int(manifest["files"][rel]["size"])
                buf = torch.empty(size, dtype=torch.uint8)
                recvs.append((rel, buf, dist.irecv(buf, src, group=self.group, tag=i) if size else None))
        for work in [*sends, *(w for _, _, w in recvs if w is not None)]:
            work.wait()  # a peer that died fails this wait: the launch is failing anyway
        try:
            for rel, buf, _ in recvs:
                _write_checked(tmp / rel, buf.numpy().tobytes(), manifest["files"][rel])
        except (OSError, ValueError) as exc:
            log.warning("rank %d: writing the partner node's copies failed: %s", self.env.rank, exc)
            ok = False
        return ok

    def _prune(self) -> None:
        """Leader: the committed generations beyond the KEEP newest removed (partial ones go as a save begins)."""
        committed = sorted(generations(self.node))
        for _, path in committed[:-KEEP]:
            shutil.rmtree(path, ignore_errors=True)

    def _all(self, ok: bool) -> bool:
        """Whether every rank's ``ok`` holds (collective)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    # -- restore ------------------------------------------------------------------------------------------
    def choose(self, durable_step: int | None, fields: dict) -> Choice:
        """The newest generation some node of this launch holds every file of, when at least as new as
        ``durable_step`` and written by this run's config and code (``fields``: the manifest fields that must
        match). Collective; every rank gets the same choice."""
        if not self.enabled:
            return Choice(None, why="checkpoints in node memory are off")
        held = self._held() if self.leader else None
        views = self.agreement.gather(held)
        # Every rank judges the same gathered views; a node holding another manifest for a step is no holder.
        by_step: dict[int, dict] = {}  # each step's manifest: the one most nodes hold (they are copies)
        for step in sorted({step for view in views for step in (view or {})}):
            copies = [json.dumps(v[step][0], sort_keys=True) for v in views if v and step in v]
            by_step[step] = json.loads(max(set(copies), key=copies.count))
        why = "no checkpoint in node memory"
        for step in sorted(by_step, reverse=True):
            manifest = by_step[step]
            if durable_step is not None and step < durable_step:
                why = f"the newest checkpoint in node memory (step {step}) is older than the durable one"
                break
            mismatch = [k for k, v in fields.items() if manifest.get(k) != v]
            if mismatch:
                why = f"the checkpoint in node memory at step {step} was written with another {mismatch[0]}"
                continue
            same = [v[step][1] if v and step in v and v[step][0] == manifest else set() for v in views]
            holders = {rel: [n for n, files in enumerate(same) if rel in files] for rel in manifest["files"]}
            lost = [rel for rel, nodes in holders.items() if not nodes]
            if lost:
                why = f"no node holds {lost[0]} of the checkpoint in node memory at step {step}"
                continue
            sealed = self._sealed(manifest)
            if sealed is not None:
                why = f"the checkpoint in node memory at step {step}: {sealed}"
                continue
            return Choice(step, manifest, why="")
        return Choice(None, why=why)

    def _held(self) -> dict[int, tuple[dict, set[str]]]:
        """Leader: this node's committed generations, {step: (manifest, the files present at their size)}."""
        out = {}
        try:
            for step, path in generations(self.node):
                try:
                    manifest = json.loads((path / MANIFEST).read_text())
                except (OSError, ValueError):
                    continue
                files = manifest.get("files", {}) if isinstance(manifest, dict) else {}
                out[step] = (manifest, {rel for rel, m in files.items() if _size(path / rel) == m.get("size")})
        except OSError as exc:
            log.warning("rank %d: reading %s failed: %s", self.env.rank, self.node, exc)
        return out

    def _sealed(self, manifest: dict) -> str | None:
        """Rank 0's verdict on the manifest's seal, on every rank."""
        problem = None
        if self.env.rank == 0 and self.identity is not None:
            found = manifest_problem(manifest, self.identity)
            problem = found[1] if found else None
        return self.agreement.from_rank0(problem)

    def fetch(self, choice: Choice) -> tuple[Path, int]:
        """Complete generation ``choice`` in this node's folder from the nodes that hold its files; (its path, the
        files the nodes received, over all nodes). Collective: raises OSError on every rank, or on none."""
        step, manifest = choice.step, choice.manifest
        path = self.node / step_name(step)
        mine = None
        if self.leader:
            held = self._held().get(step)
            mine = held[1] if held is not None and held[0] == manifest else set()
        views = self.agreement.gather(mine)
        plan = []  # (tag, file, size, source rank, nodes lacking it)
        for tag, rel in enumerate(sorted(manifest["files"])):
            holders = [n for n, leader in enumerate(self.leaders) if rel in (views[leader] or set())]
            lacking = [n for n in range(len(self.leaders)) if n not in holders]
            if lacking:
                plan.append((tag, rel, int(manifest["files"][rel]["size"]), self.leaders[holders[0]], lacking))
        problem, outgoing = None, {}
        try:
            outgoing = {
                tag: (path / rel).read_bytes() for tag, rel, size, src, _ in plan if src == self.env.rank and size
            }
        except OSError as exc:
            problem = f"rank {self.env.rank}: {exc}"
        self._raise_any(step, problem)
        works, received = [], []
        for tag, rel, size, source, lacking in plan:
            if tag in outgoing:
                data = _as_tensor(outgoing[tag])
                works += [dist.isend(data, self.leaders[n], group=self.group, tag=tag) for n in lacking]
            if self.leader and self.node_index in lacking:
                buf = torch.empty(size, dtype=torch.uint8)
                if size:
                    works.append(dist.irecv(buf, source, group=self.group, tag=tag))
                received.append((rel, buf))
        for work in works:
            work.wait()
        try:
            for rel, buf in received:
                _write_checked(path / rel, buf.numpy().tobytes(), manifest["files"][rel])
            if self.leader and received:
                (path / MANIFEST).write_text(json.dumps(manifest))
        except (OSError, ValueError) as exc:
            problem = f"rank {self.env.rank}: {exc}"
        self._raise_any(step, problem)
        return path, int(sum(self.agreement.gather(len(received))))

    def _raise_any(self, step: int, problem: str | None) -> None:
        """OSError on every rank when some rank has a problem (collective)."""
        problems = [p for p in self.agreement.gather(problem) if p]
        if problems:
            raise OSError(f"completing the checkpoint in node memory at step {step} failed: {problems[0]}")

    # -- clean --------------------------------------------------------------------------------------------
    def remove(self) -> None:
        """This node's folder removed (the leader), and the run's folder once empty: the run needs none of it
        again (collective: every rank is past its last restore)."""
        if not self.enabled:  # another user's folder in the way, or none made: nothing of this run's to remove
            return
        dist.barrier(group=self.group)
        if self.leader:
            shutil.rmtree(self.node, ignore_errors=True)
            with contextlib.suppress(OSError):  # other nodes' folders still there (they remove theirs)
                self.run_root.rmdir()


class _Planner(DefaultSavePlanner):
    """DCP's planner, its plans cached from one save in node memory to the next (the same state's layout every
    time): a save then skips gathering every rank's plan. A class of its own: DCP keys its cache by the class."""


def forget_plans() -> None:
    """The cached plans dropped (an in-process restart: a spare that joins has none, and every rank must plan the
    next save alike)."""
    for name in ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
                 "_cached_metadata"):  # fmt: skip
        getattr(SavePlanner, name, {}).pop(_Planner.__name__, None)


def _tensor_bytes(obj) -> int:
    """Bytes of this rank's own tensors in a (nested) state dict."""
    if isinstance(obj, torch.Tensor):
        return nbytes(obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _write_checked(path: Path, data: bytes, meta: dict) -> None:
    """A copy received from another node, written only if it is the file the manifest names."""
    if len(data) != int(meta["size"]) or hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise ValueError(f"{path.name} received from another node does not match the manifest's SHA-256")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    tmp.rename(path)
