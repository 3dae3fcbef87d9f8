"""bench/data.py's parts that need no server: the preparation's tokens/s against the tokenizer's own encoder, and
the windowed order's memory and time against the permutation (bench/README.md)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

from common import ROOT  # bench/ is on sys.path

TOKENIZER = ROOT / "examples" / "lm_bpe" / "tokenizer.json"


# ------------------------------------------------------------------------------------------------------ prepare
ENCODE_ONLY = """
import sys, time, json
from pathlib import Path
import tokenizers
sys.path.insert(0, sys.argv[3])
from trainer.data.prepare import PrepareSpec, select_files
spec = PrepareSpec(source="stdlib", include=("*.py",), max_source_bytes=int(sys.argv[2]), val_fraction=0.05,
                   shard_tokens=4_000_000)
texts = [p.read_bytes().decode("utf-8", errors="replace") for _, p in select_files(spec)]
tok = tokenizers.Tokenizer.from_file(sys.argv[1])
t = time.perf_counter()
n = 0
for i in range(0, len(texts), 256):
    n += sum(len(e.ids) + 1 for e in tok.encode_batch_fast(texts[i:i + 256], add_special_tokens=False))
print(json.dumps({"tokens": n, "seconds": time.perf_counter() - t}))
"""


def encode_only(max_bytes: int) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", ENCODE_ONLY, str(TOKENIZER), str(max_bytes), str(ROOT)],
                         capture_output=True, text=True, env=env, check=True)  # fmt: skip
    return json.loads(out.stdout)


def timed_prepare(source: str, out: Path, *more: str) -> dict:
    """``python -m trainer.data prepare`` of ``source`` into ``out`` with the BPE tokenizer, one core per worker, the
    whole command timed; its tokens and shard digests, the output removed."""
    args = [sys.executable, "-m", "trainer.data", "prepare", "--source", source, "--out", str(out),
            "--tokenizer", str(TOKENIZER), "--val-fraction", "0.1", *more]  # fmt: skip
    one_core = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}  # per worker: one core
    t = time.perf_counter()
    subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True, env=one_core)
    seconds = time.perf_counter() - t
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = sum(manifest["tokens"].values())
    shas = [s["sha256"] for split in manifest["splits"].values() for s in split]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return {"tokens": tokens, "seconds": seconds, "shards_sha256": shas}


def prepare_run(max_bytes: int, workers: int, work: Path) -> dict:
    out = work / f"prep-{workers}-{time.monotonic_ns()}"
    return timed_prepare("stdlib", out, "--include", "*.py", "--max-bytes", str(max_bytes), "--workers", str(workers))


def part_prepare(args, work: Path) -> dict:
    max_bytes = int(args.prepare_mb * 1e6)
    workers = sorted({1, *[w for w in (2, 4, 8, 16) if w <= args.max_workers], args.max_workers})
    encode, runs = [], {w: [] for w in workers}
    for _ in range(args.rounds):
        encode.append(encode_only(max_bytes))
        for w in workers:
            runs[w].append(prepare_run(max_bytes, w, work))
    identical = len({tuple(r["shards_sha256"]) for rs in runs.values() for r in rs}) == 1
    base = statistics.median(e["tokens"] / e["seconds"] for e in encode)
    rates = {w: statistics.median(r["tokens"] / r["seconds"] for r in rs) for w, rs in runs.items()}
    return {
        "source_mb": args.prepare_mb,
        "tokens": runs[1][0]["tokens"],
        "encode_batch_tokens_per_s": base,
        "prepare_tokens_per_s": rates,
        "one_worker_vs_encode_batch": rates[1] / base,
        "scaling_vs_one_worker": {w: rates[w] / rates[1] for w in workers},
        "identical_shards": identical,
    }


# ----------------------------------------------------------------------------------------------------- formats
def write_formats(max_bytes: int, folder: Path) -> dict[str, Path]:
    """The stdlib texts of encode_only, a document per record, in each record format; the text files as they are."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from trainer.data.prepare import PrepareSpec, select_files

    spec = PrepareSpec(source="stdlib", include=("*.py",), max_source_bytes=max_bytes, val_fraction=0.05,
                       shard_tokens=4_000_000)  # fmt: skip
    texts = [p.read_bytes().decode("utf-8", errors="replace") for _, p in select_files(spec)]
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    out = {}
    for name, write in {
        "jsonl": lambda p: p.write_bytes(lines),
        "jsonl.gz": lambda p: p.write_bytes(gzip.compress(lines, compresslevel=6)),
        "jsonl.zst": lambda p: p.write_bytes(zstandard.ZstdCompressor().compress(lines)),
        "parquet": lambda p: pq.write_table(pa.table({"text": texts}), p, row_group_size=256),
        "arrow": lambda p: _arrow_stream(pa, p, texts),
    }.items():
        path = folder / name.split(".")[0] / f"corpus.{name}"
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
        out[name] = path
    return out


def _arrow_stream(pa, path: Path, texts: list[str]) -> None:  # noqa: ANN001
    table = pa.table({"text": texts})
    sink = pa.OSFile(str(path), "wb")
    with sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=256)


def prepare_file(path: Path, work: Path) -> dict:
    return timed_prepare(str(path), work / f"prep-{path.name}-{time.monotonic_ns()}", "--workers", "1")


def part_formats(args, work: Path) -> dict:
    """One worker's preparation of the same documents from each format, against encode_batch on their texts."""
    max_bytes = int(args.prepare_mb * 1e6)
    files = write_formats(max_bytes, work / "formats")
    encode, runs = [], {name: [] for name in files}
    for _ in range(args.rounds):
        encode.append(encode_only(max_bytes))
        for name, path in files.items():
            runs[name].append(prepare_file(path, work))
    base = statistics.median(e["tokens"] / e["seconds"] for e in encode)
    rates = {name: statistics.median(r["tokens"] / r["seconds"] for r in rs) for name, rs in runs.items()}
    return {
        "source_mb": args.prepare_mb,
        "encode_batch_tokens_per_s": base,
        "tokens": {name: rs[0]["tokens"] for name, rs in runs.items()},
        "prepare_tokens_per_s": rates,
        "vs_encode_batch": {name: rate / base for name, rate in rates.items()},
    }


# ------------------------------------------------------------------------------------------------------- order
def measure_order(build, position: int) -> dict:
    build().take(0, 8)  # warm: numpy's generators and the code paths, outside the measurement
    tracemalloc.start()
    t = time.perf_counter()
    order = build()
    order.take(position, 512)  # builds the epoch
    built = time.perf_counter() - t
    steps = []
    for i in range(20):
        t = time.perf_counter()
        order.take(position + 512 * (i + 1), 512)
        steps.append(time.perf_counter() - t)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"peak_bytes": peak, "epoch_s": built, "step_take_s": statistics.median(steps)}


def part_order(args) -> dict:
    from trainer.data.order import PermutationOrder, WindowedOrder

    sizes = [int(n) for n in (1e6, 1e8, 1e9) if n <= args.order_max]
    windowed = {n: measure_order(lambda n=n: WindowedOrder([4096] * (n // 4096), 1, 64), n // 2) for n in sizes}
    measured = {n: measure_order(lambda n=n: PermutationOrder(n, 1), n // 2) for n in (10**6, 10**7)}
    per_sample_s = measured[10**7]["epoch_s"] / 10**7
    permutation = {}
    for n in sizes:
        if n in measured:
            permutation[n] = {**measured[n], "modelled": False}
        else:
            permutation[n] = {"peak_bytes": 8 * n, "epoch_s": per_sample_s * n, "modelled": True}
    return {"windowed": windowed, "permutation": permutation}
