"""``python -m trainer.data prepare --source DIR|FILE --out OUT [--format F] [--tokenizer tokenizer.json]
[--workers N]``: a corpus (text files, JSON lines, Parquet, Arrow, token arrays) -> sharded HDF5 tokens + manifest
(bytes, the ids of a ``tokenizers`` tokenizer, or the ids already in token files), over N processes; OUT may be an
object-storage URL. Under ``srun`` (one task per node) the tasks share the work; a killed preparation
run again continues where it stopped."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from runconfig.schema import MIN_SHARD_TOKENS, StorageConfig
from rundir.contract import INJECT_VAR
from rundir.slurmvars import slurm_task
from storage.objstore import Store, StoreError, is_url, local_path
from trainer.data.formats import INCLUDE, KINDS, TOKEN_DTYPES
from trainer.data.prepare import PART_BYTES, STDLIB, PrepareSpec, TokenizerError, prepare
from trainer.observe.inject import parse


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


def default_include(fmt: str) -> tuple[str, ...]:
    """The files taken when no --include is given: the format's endings (every known one for auto)."""
    if fmt != "auto":
        return INCLUDE[fmt]
    return tuple(dict.fromkeys(p for kind in KINDS for p in INCLUDE[kind]))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.data")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize a corpus into HDF5 shards")
    p.add_argument("--source", required=True, help=f"the corpus: a folder, one file, or '{STDLIB}' (Python's stdlib)")
    p.add_argument("--out", required=True, help="output folder or URL, e.g. s3://bucket/prefix (no dataset there yet)")
    p.add_argument("--format", default="auto", choices=("auto", *KINDS),
                   help="how the files are read (auto: by each file's ending, text otherwise)")  # fmt: skip
    p.add_argument("--field", default="text", help="the JSON field or Parquet / Arrow column of the text")
    p.add_argument("--token-dtype", choices=TOKEN_DTYPES, help="dtype of raw .bin token files")
    p.add_argument("--vocab-size", type=int_at_least(2), help="token files without --tokenizer: their vocabulary")
    p.add_argument("--eos", type=int_at_least(0), help="token files without --tokenizer: the end-of-document id")
    p.add_argument("--include", action="append",
                   help="glob of files to take (repeatable; default: the format's endings, *.py *.txt *.md for text, "
                   "all of them for auto)")  # fmt: skip
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
    p.add_argument(
        "--workers", type=int_at_least(1), default=default_workers(), help="processes (default: the CPUs this may use)"
    )
    p.add_argument("--part-mb", type=int_at_least(1), default=PART_BYTES >> 20, help="source MB per unit of work")
    p.add_argument("--work", type=Path, help="work folder (default: beside OUT, or under $HPC_DATA_CACHE for a URL); "
                   "with several tasks it must be on a file system they all see")  # fmt: skip
    p.add_argument("--endpoint-url", help="S3 endpoint for an s3:// --out (default: $AWS_ENDPOINT_URL, else AWS)")
    p.add_argument("--task", type=int, default=None, help="this task's index (default: $SLURM_PROCID, else 0)")
    p.add_argument("--tasks", type=int, default=None, help="number of tasks (default: $SLURM_NTASKS, else 1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    slurm_procid, slurm_ntasks = slurm_task(os.environ)
    task = args.task if args.task is not None else slurm_procid
    tasks = args.tasks if args.tasks is not None else slurm_ntasks
    if not 0 <= task < tasks:
        print(f"error: --task {task} must be in [0, --tasks {tasks}).", file=sys.stderr)
        return 2
    try:
        spec = PrepareSpec(
            source=args.source,
            include=tuple(args.include or default_include(args.format)),
            max_source_bytes=args.max_bytes,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
            tokenizer=None if args.tokenizer is None else str(args.tokenizer),
            format=args.format,
            field=args.field,
            token_dtype=args.token_dtype,
            vocab_size=args.vocab_size,
            eos=args.eos,
        )
    except ValueError as exc:  # the argument types above already refuse these; kept for the spec's own checks
        print(f"error: bad prepare arguments: {exc}.", file=sys.stderr)
        return 2
    if not is_url(args.out) and (Path(local_path(args.out)) / "manifest.json").exists():
        print(
            f"error: {args.out} already holds a prepared dataset (manifest.json); choose another --out.",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    try:
        manifest = prepare(
            spec, args.out, progress=True, workers=args.workers, part_bytes=args.part_mb << 20, task=task,
            tasks=tasks, work=args.work, store=Store(StorageConfig(endpoint_url=args.endpoint_url)),
            part_delay_s=sum(f.value for f in parse(os.environ.get(INJECT_VAR, "")) if f.kind == "slow_part"
                             and f.rank == task),
        )  # fmt: skip
    except TokenizerError as exc:
        print(f"error: --tokenizer: {exc}.", file=sys.stderr)
        return 2
    except (OSError, ValueError, StoreError) as exc:
        print(f"error: cannot prepare {args.source} into {args.out}: {str(exc).rstrip('.')}.", file=sys.stderr)
        return 2
    print(_summary(manifest, args.out, task, tasks, time.perf_counter() - start))
    return 0


def _summary(manifest: dict | None, out: str, task: int, tasks: int, seconds: float) -> str:
    """The closing line: what task 0 wrote, or (``manifest`` None) that another task's share is done."""
    if manifest is None:
        return f"task {task} of {tasks}: its share is done ({seconds:.1f} s); task 0 writes {out}"
    shards = sum(len(s) for s in manifest["splits"].values())
    return (
        f"prepared {manifest['source_files']} files ({manifest['source_bytes'] / 1e6:.1f} MB) into {shards} shards "
        f"in {out}: {manifest['tokens']['train']:,} train / {manifest['tokens']['val']:,} val tokens "
        f"(tokenizer {manifest['tokenizer']}, vocabulary {manifest['vocab_size']:,}), "
        f"{seconds:.1f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
