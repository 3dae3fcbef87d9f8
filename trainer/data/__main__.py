"""``python -m trainer.data prepare --source DIR --out OUT``: text files -> sharded HDF5 tokens + manifest."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from trainer.data.prepare import STDLIB, PrepareSpec, prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.data")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize a folder of text files into HDF5 shards")
    p.add_argument("--source", required=True, help=f"folder of text files, or '{STDLIB}' for Python's stdlib")
    p.add_argument("--out", required=True, type=Path, help="output folder (must not hold a dataset yet)")
    p.add_argument("--include", action="append", help="glob of files to take (repeatable; default: *.py *.txt *.md)")
    p.add_argument("--max-bytes", type=int, default=0, help="stop after this many source bytes (0: all)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="fraction of files held out")
    p.add_argument("--shard-tokens", type=int, default=4_000_000, help="tokens per shard")
    args = parser.parse_args(argv)
    spec = PrepareSpec(
        source=args.source,
        include=tuple(args.include or ("*.py", "*.txt", "*.md")),
        max_source_bytes=args.max_bytes,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
    )
    if (args.out / "manifest.json").exists():
        print(
            f"error: {args.out} already holds a prepared dataset (manifest.json); choose another --out.",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    try:
        manifest = prepare(spec, args.out, progress=True)
    except (OSError, ValueError) as exc:
        print(f"error: cannot prepare {args.source}: {exc}.", file=sys.stderr)
        return 2
    shards = sum(len(s) for s in manifest["splits"].values())
    print(
        f"prepared {manifest['source_files']} files ({manifest['source_bytes'] / 1e6:.1f} MB) into {shards} shards "
        f"in {args.out}: {manifest['tokens']['train']:,} train / {manifest['tokens']['val']:,} val tokens, "
        f"{time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
