"""Where a config's prepared dataset is (data.path, or a cache folder keyed by its preparation), and the
preparation it names: for the ranks (trainer/data/resolve.py) and for tools without MPI (trainer/export.py)."""

from __future__ import annotations

from pathlib import Path

from runconfig.schema import DataConfig
from trainer.data.prepare import STDLIB, PrepareSpec, TokenizerError
from trainer.errors import UserError


def prepare_spec(cfg: DataConfig) -> PrepareSpec:
    return PrepareSpec(
        source=cfg.source,
        include=tuple(cfg.include),
        max_source_bytes=cfg.max_source_bytes,
        val_fraction=cfg.val_fraction,
        shard_tokens=cfg.shard_tokens,
        tokenizer=cfg.tokenizer,
        format=cfg.format,
        field=cfg.field,
        token_dtype=cfg.token_dtype,
        vocab_size=cfg.vocab_size,
        eos=cfg.eos,
    )


def dataset_folder(cfg: DataConfig, cache: Path) -> Path:
    """The prepared dataset's folder: data.path, or a cache folder keyed by the preparation (tokenizer included).
    Raises UserError when data.tokenizer cannot be read."""
    if cfg.path:
        return Path(cfg.path).expanduser()
    spec = prepare_spec(cfg)
    stem = "stdlib" if cfg.source == STDLIB else Path(cfg.source).name or "data"
    try:
        key = spec.key()
    except TokenizerError as exc:
        raise UserError(tokenizer_problem(exc)) from None
    return cache / f"{stem}-{key}"


def tokenizer_problem(exc: TokenizerError) -> str:
    return f"data.tokenizer: {exc}. Unset data.tokenizer to train on bytes (vocabulary 257)."
