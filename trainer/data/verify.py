"""Start-up checks of a prepared dataset against its manifest, beyond the cheap per-shard ones of
``TokenShards.verify``: the vocabulary against the model's, and each shard's SHA-256 (split over the ranks)."""

from __future__ import annotations

import time
from pathlib import Path

from storage.digest import sha256_file
from trainer.data.dataset import reprepare_hint
from trainer.errors import UserError


def check_vocab(folder: Path, manifest: dict, vocab_size: int) -> None:
    """The model must have an embedding row for every token the data can hold."""
    data_vocab = int(manifest["vocab_size"])
    if vocab_size < data_vocab:
        raise UserError(
            f"model.vocab_size={vocab_size} is smaller than the dataset's vocabulary: vocab_size={data_vocab} in "
            f"{Path(folder) / 'manifest.json'} (tokenizer {manifest.get('tokenizer', '?')!r}); set "
            f"model.vocab_size to at least {data_vocab}."
        )


def shards_of_rank(manifest: dict, rank: int, world_size: int) -> list[dict]:
    """Shard i of the train + val list is checked by rank i % world_size, so the reading scales with the ranks."""
    return [*manifest["splits"]["train"], *manifest["splits"]["val"]][rank::world_size]


def check_checksums(folder: Path, shards: list[dict], rank: int) -> tuple[int, float]:
    """Hash ``shards`` and compare with the manifest's SHA-256; return (bytes read, seconds)."""
    start, total = time.perf_counter(), 0
    for shard in shards:
        path = Path(folder) / shard["file"]
        expected = shard.get("sha256")
        if not expected:
            raise UserError(
                f"rank {rank}: the manifest of {folder} records no SHA-256 for data shard {path}; "
                f"{reprepare_hint(folder)} (or set data.verify=size)."
            )
        try:
            actual = sha256_file(path)
            total += path.stat().st_size
        except OSError as exc:
            raise UserError(f"rank {rank}: data shard {path} cannot be read: {exc.strerror or exc}.") from None
        if actual != expected:
            raise UserError(
                f"rank {rank}: data shard {path} failed its checksum: expected SHA-256 {expected} (manifest.json), "
                f"got {actual}. The shard was altered or damaged after it was prepared; {reprepare_hint(folder)}."
            )
    return total, time.perf_counter() - start
