"""The data path at cluster scale, each part side by side with what it is measured against, in one invocation:
preparation, loader, order, training, checkpoint and litdata (``--parts``; what each measures: bench/README.md).
The parts live in bench/data_local.py (no server) and bench/data_s3.py (its own S3 server).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from common import bench_parser, emit  # bench/ is on sys.path
from data_local import part_formats, part_order, part_prepare
from data_s3 import Litdata, Loader, part_checkpoint, part_training, s3_server, small_dataset, upload

# Issue 56's goals against the peers, each measured side by side in one invocation: the warm node cache's samples/s
# against litdata's warm cache, and a restore from the bucket against a raw s3fs download of the same bytes.
TARGET_WARM_VS_LITDATA = 1.0
TARGET_RESTORE_VS_RAW = 0.9


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--prepare-mb", type=float, default=24, help="MB of source text for the preparation part")
    p.add_argument("--max-workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loader-samples", type=int, default=4000, help="windows read per loader measurement")
    p.add_argument("--order-max", type=float, default=1e9, help="largest order size measured (samples)")
    p.add_argument("--train-steps", type=int, default=40, help="steps of each training run (0: skip)")
    p.add_argument("--ckpt-mb", type=float, default=128, help="MB of the checkpoint part's generation")
    p.add_argument("--parts", default="prepare,formats,loader,order,training,checkpoint,litdata",
                   help="comma-separated parts")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    result: dict = {"parts": sorted(parts)}
    with tempfile.TemporaryDirectory(prefix="hpc-bench-data-") as tmp:
        work = Path(tmp)
        if "prepare" in parts:
            result["prepare"] = part_prepare(args, work)
        if "formats" in parts:
            result["formats"] = part_formats(args, work)
        if "order" in parts:
            result["order"] = part_order(args)
        if parts & {"loader", "training", "checkpoint", "litdata"}:
            data = small_dataset(work) if parts & {"loader", "training", "litdata"} else None
            with s3_server():
                url = upload(data, "small") if data is not None else ""
                readers = {}  # the loader and litdata, their rounds alternated
                if "loader" in parts:
                    readers["loader"] = Loader(args, work, data, url)
                if "litdata" in parts:
                    readers["litdata"] = Litdata(args, work, data)
                for r in range(args.rounds):
                    for reader in readers.values():
                        reader.round(r)
                result |= {name: reader.result() for name, reader in readers.items()}
                if "training" in parts and args.train_steps:
                    result["training"] = part_training(args, work, data, url)
                if "checkpoint" in parts:
                    result["checkpoint"] = part_checkpoint(args, work)
    if peers := against_peers(result):
        result["peers"] = peers
    emit(result, args.json, show)
    return 0


def against_peers(result: dict) -> dict:
    """The goals' ratios (medians of the same rounds), where the parts that give them ran."""
    out = {}
    ours = result.get("loader", {}).get("samples_per_s", {})
    lit = result.get("litdata", {}).get("samples_per_s", {})
    if "s3, warm cache" in ours and "litdata, warm cache" in lit:
        ratio = ours["s3, warm cache"] / lit["litdata, warm cache"]
        out["warm_cache_vs_litdata"] = {"ratio": ratio, "target": TARGET_WARM_VS_LITDATA,
                                        "met": ratio >= TARGET_WARM_VS_LITDATA}  # fmt: skip
    if "checkpoint" in result:
        ratio = result["checkpoint"]["restore_vs_raw"]
        out["restore_vs_raw"] = {"ratio": ratio, "target": TARGET_RESTORE_VS_RAW, "met": ratio >= TARGET_RESTORE_VS_RAW}
    return out


def table(header: list[str], rows: list[list[str]]) -> None:
    """A markdown table: the first column left-aligned, the others right-aligned."""
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def show(result: dict) -> None:
    if "prepare" in result:
        p = result["prepare"]
        base = p["encode_batch_tokens_per_s"]
        print(f"prepare ({p['source_mb']:g} MB of stdlib, BPE tokenizer, {p['tokens']:,} tokens), median tokens/s:")
        table(["", "tokens/s", "ratio"], [["encode_batch, one core", f"{base:,.0f}", "1.00"]] + [
            [f"prepare, {w} worker(s)", f"{rate:,.0f}", f"{rate / base:.2f}"]
            for w, rate in p["prepare_tokens_per_s"].items()])  # fmt: skip
        print(f"shards identical for every worker count: {p['identical_shards']}")
    if "formats" in result:
        f = result["formats"]
        base = f["encode_batch_tokens_per_s"]
        print(f"prepare from each format (the same {f['source_mb']:g} MB of documents, BPE tokenizer, one worker), "
              "median tokens/s:")  # fmt: skip
        table(["source", "tokens/s", "vs encode_batch"], [["encode_batch, one core", f"{base:,.0f}", "1.00"]] + [
            [name, f"{rate:,.0f}", f"{f['vs_encode_batch'][name]:.2f}"]
            for name, rate in f["prepare_tokens_per_s"].items()])  # fmt: skip
    if "loader" in result:
        lo = result["loader"]
        print(f"loader ({lo['samples']} windows of 257 tokens, windowed order, 4 fetch threads), median samples/s:")
        table(["source", "samples/s"], [[k, f"{v:,.0f}"] for k, v in lo["samples_per_s"].items()])
        print(
            f"bytes fetched per node: {lo['bytes_fetched_per_node']:,.0f} of a {lo['train_bytes']:,} B train split "
            f"({lo['fetched_vs_dataset']:.2f}x; the read covered {lo['epoch_share_read']:.2f} of an epoch)"
        )
    if "order" in result:
        o = result["order"]
        print("order (shards of 4,096 samples; the permutation modelled where marked):")
        rows = []
        for n, w in o["windowed"].items():
            perm = o["permutation"][n]
            mark = " (model)" if perm["modelled"] else ""
            rows.append([f"{int(n):.0e}", f"{w['peak_bytes'] / 1e6:.2f}", f"{w['epoch_s']:.3f}",
                         f"{w['step_take_s'] * 1e3:.2f}", f"{perm['peak_bytes'] / 1e6:,.0f}{mark}",
                         f"{perm['epoch_s']:.2f}{mark}"])  # fmt: skip
        table(["samples", "windowed MB", "windowed epoch s", "step take ms", "permutation MB", "permutation epoch s"],
              rows)  # fmt: skip
    if "training" in result:
        print("training (tiny, 2 x 2 ranks), medians:")
        table(["data", "time_data_s", "step_time_s", "downloads per node"], [
            [k, f"{v['time_data_s']:.4f}", f"{v['step_time_s']:.3f}", str(v["downloads_per_node"] or "-")]
            for k, v in result["training"].items()])  # fmt: skip
    if "litdata" in result:
        li = result["litdata"]
        if "skipped" in li:
            print(f"litdata: skipped: {li['skipped']}")
        else:
            print(f"litdata {li['version']} StreamingDataset ({li['samples']} windows of 257 tokens), medians:")
            ours = result.get("loader", {}).get("samples_per_s", {})
            rows = [[f"this package, {k}", f"{ours[k]:,.0f}"] for k in ("s3, cold cache", "s3, warm cache")
                    if k in ours]  # fmt: skip
            table(["source", "samples/s"], rows + [[k, f"{v:,.0f}"] for k, v in li["samples_per_s"].items()])
            print(f"bytes in litdata's cache after the cold read: {li['bytes_in_cache']:,.0f}")
    if "checkpoint" in result:
        c = result["checkpoint"]
        print(f"checkpoint ({c['bytes'] / 1e6:,.0f} MB, one process), medians:")
        table(["", "s", "MB/s"], [[k, f"{v:.2f}", f"{c['mb_per_s'][k]:,.0f}"] for k, v in c["seconds"].items()])
        print(f"trainer vs raw: save {c['save_vs_raw']:.2f}x, restore {c['restore_vs_raw']:.2f}x")
    if "peers" in result:
        names = {"warm_cache_vs_litdata": "warm node cache vs litdata's warm cache (samples/s)",
                 "restore_vs_raw": "restore from the bucket vs raw s3fs get_file (time)"}  # fmt: skip
        print("against the peers (medians of the same alternating rounds):")
        table(["", "ratio", "target", "met"], [[names[k], f"{v['ratio']:.2f}", f">= {v['target']:g}", str(v["met"])]
                                               for k, v in result["peers"].items()])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
