"""``python -m trainer.data prepare --source DIR --out OUT [--tokenizer tokenizer.json]``: text files -> sharded
HDF5 tokens + manifest (bytes, or the ids of a ``tokenizers`` tokenizer)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

from runconfig.schema import MIN_SHARD_TOKENS
from trainer.data.prepare import STDLIB, PrepareSpec, TokenizerError, prepare


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum (a bad value exits with status 2 before any work)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def open_fraction(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.data")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize a folder of text files into HDF5 shards")
    p.add_argument("--source", required=True, help=f"folder of text files, or '{STDLIB}' for Python's stdlib")
    p.add_argument("--out", required=True, type=Path, help="output folder (must not hold a dataset yet)")
    p.add_argument("--include", action="append", help="glob of files to take (repeatable; default: *.py *.txt *.md)")
    p.add_argument("--max-bytes", type=int_at_least(0), default=0, help="stop after this many source bytes (0: all)")
    p.add_argument("--val-fraction", type=open_fraction, default=0.05, help="fraction of files held out, in (0, 1)")
    p.add_argument(
        "--shard-tokens",
        type=int_at_least(MIN_SHARD_TOKENS),
        default=4_000_000,
        help=f"tokens per shard (>= {MIN_SHARD_TOKENS})",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="a `tokenizers` tokenizer.json to encode the text with (default: bytes, vocabulary 257)",
    )
    args = parser.parse_args(argv)
    try:
        spec = PrepareSpec(
            source=args.source,
            include=tuple(args.include or ("*.py", "*.txt", "*.md")),
            max_source_bytes=args.max_bytes,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
            tokenizer=None if args.tokenizer is None else str(args.tokenizer),
        )
    except ValueError as exc:  # the argument types above already refuse these; kept for the spec's own checks
        print(f"error: bad prepare arguments: {exc}.", file=sys.stderr)
        return 2
    if (args.out / "manifest.json").exists():
        print(
            f"error: {args.out} already holds a prepared dataset (manifest.json); choose another --out.",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    try:
        manifest = prepare(spec, args.out, progress=True)
    except TokenizerError as exc:
        print(f"error: --tokenizer: {exc}.", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"error: cannot prepare {args.source}: {exc}.", file=sys.stderr)
        return 2
    shards = sum(len(s) for s in manifest["splits"].values())
    print(
        f"prepared {manifest['source_files']} files ({manifest['source_bytes'] / 1e6:.1f} MB) into {shards} shards "
        f"in {args.out}: {manifest['tokens']['train']:,} train / {manifest['tokens']['val']:,} val tokens "
        f"(tokenizer {manifest['tokenizer']}, vocabulary {manifest['vocab_size']:,}), "
        f"{time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
