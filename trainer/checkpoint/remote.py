"""Checkpoint generations in object storage (``checkpoint.storage: s3://bucket/prefix``), with the guarantees of the
run directory's: each generation is written and committed locally first (checkpoints/, writer.py), then uploaded,
every rank its share of the files, and its ``manifest.json`` last: a prefix without one is never a generation, so
an upload that is killed or fails leaves the previous generation the newest one. Retention prunes only after an
upload (manifest first, so a half-deleted generation is never taken for one); the local copies are pruned to
``checkpoint.keep_local``. At start a remote generation newer than every local one is downloaded into checkpoints/
(every rank its share, several files at once, each hashed as it arrives and checked against the manifest's SHA-256
before the local commit), committed there, and restored from as any local one: resharding included.

Layout under the prefix: ``step_00000120/manifest.json`` and the files it lists, at the same relative paths, and
``OWNER.json``: the run the prefix belongs to (rundir/identity.py), made by its first launch with a conditional write
(If-None-Match) and read back. A launch of another run refuses the prefix, and a generation whose manifest names
another run, or that the run's key does not authenticate, is never downloaded (so never unpickled).
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import json
import logging
import shutil
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rundir.checkpoints import (
    MANIFEST,
    NO_BEST,
    STEP_RE,
    TMP_PREFIX,
    Best,
    CheckpointInvalid,
    commit,
    generations,
    manifest_digest,
    validate,
)
from rundir.identity import RunIdentity, manifest_problem
from storage.files import fsync_path
from storage.ioretry import GaveUp
from storage.objstore import Store, StoreError, StoreUnavailable, join
from storage.safepath import UnsafeName, safe_join
from trainer.checkpoint.agreement import Agreement, Failed
from trainer.checkpoint.reader import shares
from trainer.errors import UserError

log = logging.getLogger(__name__)
OWNER = "OWNER.json"
FILES_AT_ONCE = 4  # a rank's files downloaded at once at a restore (each in ranges: Store.download_hashed)


def download_checked(store: Store, url: str, dest: Path, meta: dict) -> bool:
    """A generation's file into ``dest``, hashed as it arrives (Store.download_hashed): False, and the copy removed,
    when it does not match the manifest's SHA-256; else True, the copy fsynced (on disk before a local commit, as a
    save's files are). Raises what the store and the local disk raise."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if store.download_hashed(url, str(dest), int(meta["size"]), what="checkpoint file") != meta["sha256"]:
        dest.unlink()
        return False
    fsync_path(dest)
    return True


class RemoteGenerations:
    def __init__(
        self,
        *,
        store: Store,
        url: str,
        agreement: Agreement,
        root: Path,
        keep_last: int,
        keep_every: int,
        identity: RunIdentity | None = None,
        run_dir: Path | None = None,
        before_upload: Callable[[], None] | None = None,
        best: Best = NO_BEST,
    ) -> None:
        """``identity`` and ``run_dir`` (rank 0): the run the prefix must belong to."""
        self.store, self.url, self.agreement, self.root = store, url.rstrip("/"), agreement, root
        self.identity, self.run_dir = identity, run_dir
        self._owned = False  # rank 0: the prefix's owner record is this run's (checked once a launch)
        self.before_upload = before_upload  # tests: HPC_INJECT slow_upload
        self.rank, self.world_size = agreement.rank, agreement.world_size
        self.keep_last, self.keep_every, self.best = keep_last, keep_every, best

    # -- save -------------------------------------------------------------------------------------------------
    def upload(self, final: Path, step: int) -> None:
        """Upload the committed local generation ``final``: every rank its share, then rank 0 the manifest.
        Collective; raises Failed (transient, or not) as a save does."""
        self._claim()
        manifest = self.agreement.from_rank0(json.loads((final / MANIFEST).read_text()) if self.rank == 0 else None)
        sizes = {rel: int(meta["size"]) for rel, meta in manifest["files"].items()}
        mine = shares(sizes, self.world_size)[self.rank]

        def attempt(began: float) -> None:
            error = None
            for rel in mine:
                try:
                    self._put(final / rel, join(self.url, final.name, rel))
                except (OSError, StoreError) as exc:
                    error = (exc, f"uploading {final / rel} to {join(self.url, final.name, rel)}: {exc}")
                    break
            self.agreement.agree(error, began)

        self.agreement.retrying(f"upload of checkpoint {final.name}", attempt)
        error = None
        if self.rank == 0:
            try:
                self._put(final / MANIFEST, join(self.url, final.name, MANIFEST))  # the remote commit
            except (OSError, StoreError) as exc:
                error = (exc, f"uploading {final / MANIFEST}: {exc}")
        self.agreement.agree(error, time.monotonic(), final=True)
        if self.rank == 0:
            log.info("checkpoint %s uploaded to %s", final.name, join(self.url, final.name))

    def prune(self) -> list[str]:
        """Rank 0, after an upload: delete the generations beyond the newest ``keep_last`` (not multiples of
        ``keep_every``), manifest first, and the prefixes of uploads that never committed and are older than the
        newest committed generation. A failure is logged and left to the next upload."""
        try:
            committed, partial = self._listing()
            doomed = [n for s, n in committed[: -self.keep_last] if not (self.keep_every and s % self.keep_every == 0)]
            if self.best.count and doomed:  # checkpoint.keep_best: the doomed ones' manifests say what they scored
                kept = self.best.names([(n, self._manifest(n)) for _, n in committed])
                doomed = [n for n in doomed if n not in kept]
            newest = committed[-1][0] if committed else -1
            doomed_partial = [n for s, n in partial if s < newest]
            for name in doomed:
                self._delete(name, manifest_first=True)
            for name in doomed_partial:
                self._delete(name, manifest_first=False)
            return doomed + doomed_partial
        except (OSError, StoreError) as exc:
            log.warning("pruning the checkpoints in %s failed (%s); they stay until the next upload", self.url, exc)
            return []

    def _manifest(self, name: str) -> dict | None:
        """A committed generation's manifest, or None when it cannot be read as one."""
        try:
            manifest = json.loads(self.store.read_bytes(join(self.url, name, MANIFEST), what="checkpoint manifest"))
        except (StoreError, ValueError):
            return None
        return manifest if isinstance(manifest, dict) else None

    # -- restore ------------------------------------------------------------------------------------------------
    def fetch_newest(self, warn) -> str | None:
        """Before a restore: download the newest remote generation that is newer than every local one and verifies,
        into checkpoints/, and commit it there; its name, or None. Collective."""
        self._claim()
        plan = None
        if self.rank == 0:
            plan = self._remote_newer_than_local()
        candidates = self.agreement.from_rank0(plan)
        if isinstance(candidates, str):
            raise UserError(candidates, collective=True)
        for name, manifest in candidates or []:
            problem = self._download(name, manifest)
            if problem is None:
                if self.rank == 0:
                    log.info("checkpoint %s downloaded from %s", name, join(self.url, name))
                return name
            warn(f"skipping checkpoint {join(self.url, name)}: {problem}")
        return None

    def _remote_newer_than_local(self) -> list[tuple[str, dict]] | str:
        """Rank 0: the committed remote generations newer than the newest local one, newest first, with their
        manifests (self-checksum checked); or the message of an error that stops the run."""
        try:
            return self._newer(self._listing()[0])
        except (StoreError, OSError) as exc:
            return f"checkpoint.storage {self.url}: {exc}"

    def _newer(self, committed: list[tuple[int, str]]) -> list[tuple[str, dict]]:
        local = -1
        for step, path in reversed(generations(self.root)):
            try:
                validate(path, verify_hashes=False)
                local = step
                break
            except (CheckpointInvalid, OSError):
                continue
        out = []
        for step, name in reversed(committed):
            if step <= local:
                break
            raw = self.store.read_bytes(join(self.url, name, MANIFEST), what="checkpoint manifest")
            try:
                manifest = json.loads(raw)
                if manifest.get("manifest_sha256") != manifest_digest(manifest):
                    raise ValueError("its self-checksum does not match")
            except (ValueError, AttributeError) as exc:
                log.warning("skipping checkpoint %s: its manifest is damaged (%s)", join(self.url, name), exc)
                continue
            problem = manifest_problem(manifest, self.identity) if self.identity is not None else None
            if problem and problem[0] == "other":
                return (f"checkpoint.storage {self.url}: generation {name} belongs to another run: {problem[1]}; this "
                        f"run is {self.run_dir} (run id {self.identity.short()}). Two runs must not share a prefix: "
                        "give this run one of its own.")  # fmt: skip
            if problem:
                log.warning("skipping checkpoint %s: %s", join(self.url, name), problem[1])
                continue
            out.append((name, manifest))
        return out

    # -- the owner record -----------------------------------------------------------------------------------------
    def _claim(self) -> None:
        """The prefix is this run's: its owner record made if there is none (a conditional write, read back), else
        it must name this run. Collective: every rank learns rank 0's verdict; another run's prefix stops the run."""
        problem = None
        if self.rank == 0 and not self._owned and self.identity is not None:
            try:
                problem = self._owner_problem()
            except (StoreError, OSError) as exc:
                problem = f"checkpoint.storage {self.url}: its owner record cannot be read or made: {exc}"
            self._owned = problem is None
        problem = self.agreement.from_rank0(problem)
        if problem:
            raise UserError(problem, collective=True)

    def _owner_problem(self) -> str | None:
        url = join(self.url, OWNER)
        record = self._owner()
        if record is None:
            mine = {"run_id": self.identity.run_id, "run_dir": str(self.run_dir), "user": getpass.getuser(),
                    "host": socket.gethostname(), "time": time.time()}  # fmt: skip
            data = json.dumps(mine, indent=2).encode()

            def create(fs, path) -> None:
                with contextlib.suppress(FileExistsError):  # If-None-Match: another run made it first (read below)
                    fs.pipe_file(path, data, mode="create")

            self.store.call(create, url, what="checkpoint owner record")
            record = self._owner()  # read back: a server that ignores If-None-Match lets the last writer win
        if record is not None and record.get("run_id") == self.identity.run_id:
            return None
        owner = f"run {record.get('run_dir')} (run id {str(record.get('run_id'))[:12]})" if record else "no run"
        return (f"checkpoint.storage {self.url} belongs to {owner}, not to this run {self.run_dir} (run id "
                f"{self.identity.short()}): two runs given one prefix would resume from, overwrite and prune each "
                "other's checkpoints. Give this run a prefix of its own (a sweep's elements get theirs).")  # fmt: skip

    def _owner(self) -> dict | None:
        url = join(self.url, OWNER)
        if not self.store.call(lambda fs, p: fs.exists(p), url, what="owner record"):
            return None
        try:
            record = json.loads(self.store.read_bytes(url, what="checkpoint owner record"))
        except ValueError:
            return {"run_dir": "unknown (a damaged record)", "run_id": "?"}
        return record if isinstance(record, dict) else {"run_dir": "unknown (a damaged record)", "run_id": "?"}

    def _download(self, name: str, manifest: dict) -> str | None:
        """Every rank downloads and checks its share into checkpoints/.tmp-NAME; rank 0 commits it. The problem
        that makes the generation unusable (a corrupt or missing object), or None. Collective."""
        tmp = self.root / f"{TMP_PREFIX}{name}"
        error = None
        if self.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True, mode=0o700)
            except OSError as exc:
                error = (exc, f"cannot create {tmp}: {exc}")
        self.agreement.agree(error, time.monotonic(), final=True)
        sizes = {rel: int(meta["size"]) for rel, meta in manifest["files"].items()}
        mine = shares(sizes, self.world_size)[self.rank]
        try:  # the manifest comes from the bucket: its names never become paths outside the generation
            dests = {rel: safe_join(tmp, rel) for rel in mine}
        except UnsafeName as exc:
            problem, crash, fatal = f"its manifest names a file {exc} (refused)", None, None
        else:
            problem, crash, fatal = self._fetch_files(name, manifest, dests)
        reports = self.agreement.gather((problem, crash, fatal))
        if any(f for _, _, f in reports):
            raise UserError(next(f for _, _, f in reports if f), collective=True)
        if any(c for _, c, _ in reports):
            raise GaveUp(errno.ECONNRESET, next(c for _, c, _ in reports if c))
        problems = [p for p, _, _ in reports if p]
        if problems:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            return problems[0]
        error = None
        if self.rank == 0:
            body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
            try:
                commit(tmp, self.root / name, body)
            except OSError as exc:
                error = (exc, f"committing the downloaded {self.root / name}: {exc}")
        try:
            self.agreement.agree(error, time.monotonic(), final=True)
        except Failed as failed:
            raise UserError(failed.reports[0]["message"], collective=True) from None
        return None

    def _fetch_files(self, name: str, manifest: dict, dests: dict[str, Path]) -> tuple[str | None, ...]:
        """This rank's files of generation ``name`` downloaded to ``dests``, ``FILES_AT_ONCE`` at a time, each
        hashed as it arrives, removed if it does not match the manifest, else fsynced. (problem, crash, fatal) of
        the first file in share order that failed, or three Nones."""

        def fetch(rel: str) -> tuple[str | None, ...]:
            url, dest = join(self.url, name, rel), dests[rel]
            try:
                if not download_checked(self.store, url, dest, manifest["files"][rel]):
                    return f"{url} does not match its SHA-256 in the manifest (corrupt), removed", None, None
            except StoreError as exc:  # a missing object: this generation is unusable
                return str(exc), None, None
            except StoreUnavailable as exc:  # says nothing about the generation: a crash, restarted
                return None, f"rank {self.rank}: downloading {url}: {exc.strerror} (after storage.retries)", None
            except OSError as exc:  # the local disk's
                return None, None, f"rank {self.rank}: downloading {url} into {dest}: {exc.strerror or exc}"
            return None, None, None

        with ThreadPoolExecutor(FILES_AT_ONCE, thread_name_prefix="checkpoint-fetch") as pool:
            futures = [pool.submit(fetch, rel) for rel in dests]
            for future in futures:
                outcome = future.result()
                if any(outcome):
                    for rest in futures:  # those not started are not fetched
                        rest.cancel()
                    return outcome
        return None, None, None

    # -- the store ------------------------------------------------------------------------------------------------
    def _listing(self) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        """(committed, uncommitted) generations under the prefix, oldest first: step_* prefixes with and without
        a manifest.json."""

        def walk(fs, path):
            if not fs.exists(path):
                return []
            return [e["name"] for e in fs.ls(path, detail=True) if e.get("type") == "directory"]

        names = self.store.call(walk, self.url, what="checkpoint listing of", key="checkpoint.storage")
        committed, partial = [], []
        for full in names:
            name = full.rstrip("/").rsplit("/", 1)[-1]
            m = STEP_RE.fullmatch(name)
            if not m:
                continue
            has = self.store.call(lambda fs, p: fs.exists(p), join(self.url, name, MANIFEST), what="checkpoint")
            (committed if has else partial).append((int(m.group(1)), name))
        return sorted(committed), sorted(partial)

    def _delete(self, name: str, *, manifest_first: bool) -> None:
        """Every object under the generation's prefix, its manifest first (then it is no generation any more)."""
        prefix = join(self.url, name)

        def delete(fs, p):
            objects = fs.find(p)
            manifest = [o for o in objects if o.endswith(f"/{MANIFEST}") and o.count("/") == p.count("/") + 1]
            if manifest_first and manifest:
                fs.rm_file(manifest[0])
            rest = [o for o in objects if o not in manifest] if manifest_first else objects
            if rest:
                fs.rm(rest)

        self.store.call(delete, prefix, what="pruning of")

    def _put(self, local: Path, url: str) -> None:
        if self.before_upload is not None:
            self.before_upload()
        self.store.call(lambda fs, p: fs.put_file(str(local), p), url, what="checkpoint upload of")
