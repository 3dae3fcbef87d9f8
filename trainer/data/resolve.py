"""Find the prepared dataset a config names, preparing it on first use (rank 0 prepares, the others wait), and
check it against its manifest before any training."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from mpi4py import MPI

from runconfig.schema import DataConfig, StorageConfig
from storage.ioretry import RetryPolicy
from storage.objstore import Store, StoreError, StoreUnavailable, is_url
from storage.private import UnsafeFolder, private_dir
from storage.safepath import UnsafeName, check_name
from trainer.data.dataset import TokenShards, read_manifest
from trainer.data.folder import dataset_folder, prepare_spec, tokenizer_problem
from trainer.data.formats import CorpusError
from trainer.data.node_cache import NodeCache, dataset_key
from trainer.data.prepare import (
    STDLIB,
    PrepareSpec,
    TokenizerError,
    load_tokenizer,
    prepare,
    tokenizer_sha256,
)
from trainer.data.remote_source import fetch
from trainer.data.verify import check_checksums, check_vocab, shards_of_rank
from trainer.env import RuntimeEnv, agree
from trainer.errors import UserError, error_of
from trainer.observe.inject import Injector

T = TypeVar("T")
log = logging.getLogger(__name__)


def open_splits(
    cfg: DataConfig,
    seq_len: int,
    vocab_size: int | None,
    env: RuntimeEnv,
    comm: MPI.Comm,
    store: Store | None = None,
) -> tuple[TokenShards, TokenShards]:
    """Collective: every rank returns (train, val) readers, or every rank raises the same UserError.

    Rank 0 prepares the data if needed and runs the cheap checks (manifest, vocabulary, each shard's length and
    dtype); with data.verify=checksum every rank then hashes its share of the shards. Either way the ranks agree
    on the outcome before any training, so a bad shard stops the job with its file and finder named.
    ``vocab_size=None`` skips the vocabulary check (a model sized from the manifest's ``vocab_size``).
    """
    store = store or Store(StorageConfig())
    if cfg.path and is_url(cfg.path):
        return _open_remote(cfg, seq_len, vocab_size, env, comm, store)
    cfg = _localized(cfg, env, comm, store)
    folder: Path | None = None

    def find() -> None:
        nonlocal folder
        folder = dataset_folder(cfg, env.data_cache)

    agree(comm, error_of(find))
    assert folder is not None
    agree(comm, error_of(lambda: _prepare_and_check(cfg, folder, seq_len, vocab_size)) if env.rank == 0 else None)
    manifest = read_manifest(folder)
    checksummed = cfg.verify == "checksum"
    if checksummed:
        agree(comm, error_of(lambda: _check_my_shards(folder, manifest, env)))
    # Shards that matched their checksum hold what prepare wrote: no need to range-check every window read.
    injector = Injector(env.inject, env.rank)
    before_read = injector.data_read if injector.injects("eio_read") else None  # tests: HPC_INJECT
    return _splits(cfg, folder, manifest, seq_len, env, check_range=not checksummed, before_read=before_read)


def _open_remote(
    cfg: DataConfig, seq_len: int, vocab_size: int | None, env: RuntimeEnv, comm: MPI.Comm, store: Store
) -> tuple[TokenShards, TokenShards]:
    """A prepared dataset in object storage: rank 0 reads the manifest and lists the prefix once (every shard the
    manifest names must be there, at its size where the manifest records one) and passes both to the others; each
    node then streams the shards into its own cache, verified against the manifest as they arrive."""
    url = cfg.path.rstrip("/")
    found: tuple[dict, dict[str, int]] | None = None

    def look() -> None:
        nonlocal found
        found = remote_manifest(store, url)
        if vocab_size is not None:
            check_vocab(url, found[0], vocab_size)

    agree(comm, error_of(look) if env.rank == 0 else None)
    manifest, sizes = comm.bcast(found, root=0)
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else env.data_cache / "stream"
    node = env.node_names[env.rank].replace("/", "_")
    folder = root / node / dataset_key(url, manifest)
    try:
        cache = NodeCache(
            store, url, manifest, folder, max_bytes=int(cfg.cache_max_gb * 1e9), threads=cfg.stream_threads,
            rank=env.rank, sizes=sizes,
        )  # fmt: skip
    except OSError as exc:
        raise UserError(f"rank {env.rank}: data.cache_dir {folder} cannot be used: {exc}.", collective=False) from None
    checksummed = all(s.get("sha256") for split in manifest["splits"].values() for s in split)
    # every download is checked against its SHA-256: no range check then
    return _splits(cfg, folder, manifest, seq_len, env, check_range=not checksummed, cache=cache)


def _splits(
    cfg: DataConfig, folder: Path, manifest: dict, seq_len: int, env: RuntimeEnv, **reads
) -> tuple[TokenShards, TokenShards]:
    """The (train, val) readers of a dataset, with data.read_retries."""
    retry = RetryPolicy(cfg.read_retries, cfg.read_retry_backoff_s, "data.read_retries")
    train = TokenShards(folder, manifest, "train", seq_len, rank=env.rank, retry=retry, **reads)
    return train, TokenShards(folder, manifest, "val", seq_len, rank=env.rank, retry=retry, **reads)


def _localized(cfg: DataConfig, env: RuntimeEnv, comm: MPI.Comm, store: Store) -> DataConfig:
    """``cfg`` with a data.tokenizer URL fetched (by every rank) and a data.source URL mirrored (by rank 0, the rank
    that prepares) into the data cache, as local paths. Collective."""
    changes = {}
    if cfg.tokenizer and is_url(cfg.tokenizer):
        local = env.data_cache / "remote" / _digest(cfg.tokenizer) / "tokenizer.json"

        def fetch_tokenizer() -> None:
            private(local.parent)
            if not local.is_file():
                data = _user_error(lambda: store.read_bytes(cfg.tokenizer, what="tokenizer", key="data.tokenizer"))
                tmp = local.with_name(f".{local.name}.{os.getpid()}")
                tmp.write_bytes(data)
                os.replace(tmp, local)

        agree(comm, error_of(fetch_tokenizer))
        changes["tokenizer"] = str(local)
    if cfg.source != STDLIB and is_url(cfg.source):
        local = env.data_cache / "sources" / _digest(cfg.source)

        def copy() -> None:
            mirror(store, cfg.source, private(local), cfg.include, cfg.max_source_bytes)

        agree(comm, error_of(copy) if env.rank == 0 else None)
        changes["source"] = str(local)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def mirror(store: Store, url: str, folder: Path, include: list[str], max_bytes: int) -> None:
    """Copy the objects under ``url`` that the preparation takes into ``folder`` (trainer/data/remote_source.py:
    names checked, objects already there at their size skipped), or the UserError naming the URL."""
    try:
        _user_error(lambda: fetch(url, tuple(include), max_bytes, folder, store))
    except FileNotFoundError:
        raise UserError(f"data.source {url}: no objects under it match data.include {list(include)}.") from None
    except CorpusError as exc:
        raise UserError(f"{exc}. Nothing was fetched.") from None
    log.info("data.source %s: mirrored into %s", url, folder)


def private(folder: Path) -> Path:
    """``folder`` of the data cache, the user's own (storage/private.py), or the error that says whose it is."""
    try:
        return private_dir(folder, what="the data cache's folder")
    except UnsafeFolder as exc:
        raise UserError(str(exc)) from None


def _user_error(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except StoreError as exc:
        raise UserError(str(exc)) from None
    except StoreUnavailable as exc:
        raise UserError(
            f"{exc.filename}: the object store cannot be reached ({exc.strerror}) after storage.retries."
        ) from None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def remote_manifest(store: Store, url: str) -> tuple[dict, dict[str, int]]:
    """The manifest of the dataset at ``url`` and the sizes of the objects under it, checked against each other."""
    try:
        raw = store.read_bytes(f"{url}/manifest.json", what="data manifest", key="data.path")
    except StoreError as exc:
        if "no such object" in str(exc):
            raise UserError(
                f"data.path {url} has no manifest.json: it is not a prepared dataset (prepare one with "
                "`python -m trainer.data prepare --source DIR --out OUT` and upload OUT, or prepare straight to the "
                "bucket)."
            ) from None
        raise UserError(str(exc)) from None
    except StoreUnavailable as exc:
        raise UserError(
            f"data.path {url}: the object store cannot be reached ({exc.strerror}) after storage.retries; check "
            "storage.endpoint_url (or AWS_ENDPOINT_URL) and that the store is up."
        ) from None
    try:
        manifest = json.loads(raw)
        manifest["splits"]["train"], manifest["splits"]["val"], manifest["vocab_size"]  # noqa: B018
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"data manifest {url}/manifest.json is malformed ({type(exc).__name__}: {exc}).") from None
    sizes = store.sizes(url, what="data.path listing of", key="data.path")
    for split in ("train", "val"):
        for shard in manifest["splits"][split]:
            name = shard["file"]
            try:  # from the bucket: the node cache (NodeCache, fed only from here) makes it a path of its folder
                check_name(name, flat=True)
            except UnsafeName as exc:
                raise UserError(f"the manifest of {url} names a shard {exc}; refused, nothing fetched.") from None
            if name not in sizes:
                raise UserError(
                    f"data shard {url}/{name}, listed in {url}/manifest.json, is missing from the bucket: the "
                    "upload was incomplete or the shard was deleted; upload the prepared folder again."
                )
            if "bytes" in shard and sizes[name] != shard["bytes"]:
                raise UserError(
                    f"data shard {url}/{name} holds {sizes[name]} bytes, but {url}/manifest.json says "
                    f"{shard['bytes']}: the manifest does not match the shards; upload the prepared folder again."
                )
    return manifest, sizes


def _prepare_and_check(cfg: DataConfig, folder: Path, seq_len: int, vocab_size: int | None) -> None:
    if not (folder / "manifest.json").exists() and not cfg.path:
        spec = prepare_spec(cfg)
        if not is_url(cfg.source) and not spec.source_dir().exists():
            raise UserError(f"data.source {cfg.source!r}: {spec.source_dir()} does not exist.")
        log.info(
            "preparing %s into %s (first use%s)",
            spec.source_name(),
            folder,
            f", tokenizer {cfg.tokenizer}" if cfg.tokenizer else "",
        )
        try:
            workers = cfg.prepare_workers or len(os.sched_getaffinity(0))
            if workers > 1:
                if spec.tokenizer_path() is not None:
                    load_tokenizer(spec.tokenizer_path())  # its problems named here, as data.tokenizer's
                _prepare_in_child(spec, folder, workers)
            else:
                prepare(spec, folder)
        except TokenizerError as exc:
            raise UserError(tokenizer_problem(exc)) from None
        except (OSError, ValueError) as exc:
            raise UserError(f"data.source {cfg.source!r} cannot be prepared into {folder}: {exc}.") from None
    manifest = read_manifest(folder)
    if cfg.path and cfg.tokenizer:
        _check_tokenizer_matches(cfg, folder, manifest)
    if vocab_size is not None:
        check_vocab(folder, manifest, vocab_size)
    for split in ("train", "val"):
        reader = TokenShards(folder, manifest, split, seq_len)
        try:
            reader.verify()
        finally:
            reader.close()


def _prepare_in_child(spec: PrepareSpec, folder: Path, workers: int) -> None:
    """``python -m trainer.data prepare`` in a child process with ``workers`` processes of its own: a worker
    process started from a rank would import the rank's main module, which starts a rank. The child gets no MPI
    environment (it must not join the job)."""
    args = [sys.executable, "-m", "trainer.data", "prepare", "--source", spec.source, "--out", str(folder)]
    for pattern in spec.include:
        args += ["--include", pattern]
    args += ["--max-bytes", str(spec.max_source_bytes), "--val-fraction", repr(spec.val_fraction)]
    args += ["--shard-tokens", str(spec.shard_tokens), "--workers", str(workers), "--tasks", "1", "--task", "0"]
    if spec.tokenizer:
        args += ["--tokenizer", spec.tokenizer]
    env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_ENV_PREFIXES)}
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        detail = done.stderr.strip().removeprefix("error: ") or f"exit status {done.returncode}"
        raise UserError(f"data.source {spec.source!r} cannot be prepared into {folder}: {detail}")
    log.info("%s", done.stdout.strip())


#: The environment of an MPI job's ranks (MPICH's hydra, PMI, PMIx, Open MPI, Slurm's step): not for a helper.
MPI_ENV_PREFIXES = ("PMI_", "PMIX_", "PMI", "HYDRA_", "MPIR_", "MPICH_", "OMPI_", "SLURM_STEP", "I_MPI_")


def _check_tokenizer_matches(cfg: DataConfig, folder: Path, manifest: dict) -> None:
    """data.path with data.tokenizer: the dataset must have been prepared with that tokenizer."""
    try:
        sha = tokenizer_sha256(Path(cfg.tokenizer).expanduser())
    except TokenizerError as exc:
        raise UserError(tokenizer_problem(exc)) from None
    if manifest.get("tokenizer_sha256") != sha:
        raise UserError(
            f"data.tokenizer {cfg.tokenizer} is not the tokenizer the dataset at data.path {folder} was prepared "
            f"with (its manifest.json records tokenizer {manifest.get('tokenizer', '?')!r}, SHA-256 "
            f"{manifest.get('tokenizer_sha256', 'none')}); unset data.tokenizer, or prepare the data again with it."
        )


def _check_my_shards(folder: Path, manifest: dict, env: RuntimeEnv) -> None:
    mine = shards_of_rank(manifest, env.rank, env.world_size)
    nbytes, seconds = check_checksums(folder, mine, env.rank)
    log.info(
        "data.verify=checksum: %d shard(s), %.1f MB, match the manifest (%.2f s)", len(mine), nbytes / 1e6, seconds
    )
