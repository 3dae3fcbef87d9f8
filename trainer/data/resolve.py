"""Find the prepared dataset a config names, preparing it on first use (rank 0 prepares, the others wait)."""

from __future__ import annotations

import logging
from pathlib import Path

from mpi4py import MPI

from runconfig.schema import DataConfig
from trainer.data.dataset import TokenShards, read_manifest
from trainer.data.prepare import STDLIB, PrepareSpec, prepare
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
    """Collective: every rank returns (train, val) readers, or every rank raises the same UserError."""
    folder = dataset_folder(cfg, env.data_cache)
    error = None
    if env.rank == 0:
        try:
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
            for split in ("train", "val"):
                reader = TokenShards(folder, manifest, split, seq_len)
                reader.verify(vocab_size)
                reader.close()
        except UserError as exc:
            error = str(exc)
    agree(comm, error)
    manifest = read_manifest(folder)
    return TokenShards(folder, manifest, "train", seq_len), TokenShards(folder, manifest, "val", seq_len)
