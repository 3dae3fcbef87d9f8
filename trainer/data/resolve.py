"""Find the prepared dataset a config names, preparing it on first use (rank 0 prepares, the others wait), and
check it against its manifest before any training."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from mpi4py import MPI

from runconfig.schema import DataConfig
from trainer.data.dataset import TokenShards, read_manifest
from trainer.data.prepare import STDLIB, PrepareSpec, prepare
from trainer.data.verify import check_checksums, check_vocab, shards_of_rank
from trainer.env import RuntimeEnv, agree
from trainer.errors import UserError

log = logging.getLogger(__name__)


def prepare_spec(cfg: DataConfig) -> PrepareSpec:
    return PrepareSpec(
        source=cfg.source,
        include=tuple(cfg.include),
        max_source_bytes=cfg.max_source_bytes,
        val_fraction=cfg.val_fraction,
        shard_tokens=cfg.shard_tokens,
    )


def dataset_folder(cfg: DataConfig, cache: Path) -> Path:
    if cfg.path:
        return Path(cfg.path).expanduser()
    spec = prepare_spec(cfg)
    stem = "stdlib" if cfg.source == STDLIB else Path(cfg.source).name or "data"
    return cache / f"{stem}-{spec.key()}"


def open_splits(
    cfg: DataConfig, seq_len: int, vocab_size: int, env: RuntimeEnv, comm: MPI.Comm
) -> tuple[TokenShards, TokenShards]:
    """Collective: every rank returns (train, val) readers, or every rank raises the same UserError.

    Rank 0 prepares the data if needed and runs the cheap checks (manifest, vocabulary, each shard's length and
    dtype); with data.verify=checksum every rank then hashes its share of the shards. Either way the ranks agree
    on the outcome before any training, so a bad shard stops the job with its file and finder named.
    """
    folder = dataset_folder(cfg, env.data_cache)
    agree(comm, _error_of(lambda: _prepare_and_check(cfg, folder, seq_len, vocab_size)) if env.rank == 0 else None)
    manifest = read_manifest(folder)
    checksummed = cfg.verify == "checksum"
    if checksummed:
        agree(comm, _error_of(lambda: _check_my_shards(folder, manifest, env)))
    # Shards that matched their checksum hold what prepare wrote: no need to range-check every window read.
    return (
        TokenShards(folder, manifest, "train", seq_len, rank=env.rank, check_range=not checksummed),
        TokenShards(folder, manifest, "val", seq_len, rank=env.rank, check_range=not checksummed),
    )


def _error_of(check: Callable[[], None]) -> str | None:
    try:
        check()
    except UserError as exc:
        return str(exc)
    return None


def _prepare_and_check(cfg: DataConfig, folder: Path, seq_len: int, vocab_size: int) -> None:
    if not (folder / "manifest.json").exists() and not cfg.path:
        spec = prepare_spec(cfg)
        if not spec.source_dir().is_dir():
            raise UserError(f"data.source {cfg.source!r}: folder {spec.source_dir()} does not exist.")
        log.info("preparing %s into %s (first use)", spec.source_dir(), folder)
        try:
            prepare(spec, folder)
        except (OSError, ValueError) as exc:
            raise UserError(f"data.source {cfg.source!r} cannot be prepared into {folder}: {exc}.") from None
    manifest = read_manifest(folder)
    check_vocab(folder, manifest, vocab_size)
    for split in ("train", "val"):
        reader = TokenShards(folder, manifest, split, seq_len)
        try:
            reader.verify()
        finally:
            reader.close()


def _check_my_shards(folder: Path, manifest: dict, env: RuntimeEnv) -> None:
    mine = shards_of_rank(manifest, env.rank, env.world_size)
    nbytes, seconds = check_checksums(folder, mine, env.rank)
    log.info(
        "data.verify=checksum: %d shard(s), %.1f MB, match the manifest (%.2f s)", len(mine), nbytes / 1e6, seconds
    )
