"""The data path at cluster scale, each side by side with what it is measured against, in one invocation.

    python bench/data.py [--prepare-mb 24] [--rounds 3] [--loader-samples 4000] [--train-steps 40] [--json PATH]

- prepare: tokens/s of ``python -m trainer.data prepare`` with the BPE tokenizer of examples/lm_bpe on the standard
  library's sources, one worker, against the ``tokenizers`` library's own ``encode_batch`` on the same texts on one
  core (TOKENIZERS_PARALLELISM=false: the limit for one core); then 1, 2, ... up to --max-workers workers, each on
  one core. The figure includes what encode_batch alone does not: reading the files, writing the shards, hashing
  them, starting the worker processes. Rounds alternate; medians.
- loader: samples/s reading windows in the windowed order (as the trainer does: the shards of the current and the
  next window announced, fetched by 4 threads) from local disk, from the S3 server (envs/s3/server.sh) with a cold
  node cache and with a warm one; bytes fetched per node per epoch against the dataset's size.
- order: the windowed order's memory (tracemalloc peak) and time (building an epoch, and one 512-sample step's
  take) at 10^6, 10^8 and 10^9 samples (shards of 4,096 samples), against the full permutation, measured at 10^6
  and 10^7 and modelled (8 bytes and the measured time per sample) beyond.
- training: the tiny model on 2 simulated nodes x 2 ranks (--train-steps steps) from local disk and from the S3
  server with a cold cache: median time_data_s and step time, and the downloads per node.
- checkpoint: a committed generation of --ckpt-mb MB (a DCP save of random tensors, as the trainer writes one)
  uploaded by the trainer's own code (trainer/checkpoint/remote.py: the shares, then the manifest) and restored
  from the bucket (listing, download, SHA-256 of every file, local commit), against a raw s3fs upload and download
  of the same files; and torch's DCP writing to and reading from the bucket itself (FsspecWriter/FsspecReader, 4
  threads). One process. Rounds alternate; medians.
- litdata: litdata's ``StreamingDataset`` (envs/requirements-bench.txt) on the loader part's tokens, converted by
  its ``optimize`` into chunks of the same size and dtype and uploaded to the same server: samples/s reading the
  same number of windows of 257 tokens (its own shuffle, one process, as the loader part) with a cold and a warm
  cache, and the bytes it fetched. Skipped, with the reason, where litdata does not import.

Prints a table per part and a JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

from common import ROOT, lines  # bench/ is on sys.path

sys.path.insert(0, str(ROOT))

TOKENIZER = ROOT / "examples" / "lm_bpe" / "tokenizer.json"
PORT = os.environ.get("HPC_BENCH_S3_PORT", "19200")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_DEFAULT_REGION": "us-east-1"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prepare-mb", type=float, default=24, help="MB of source text for the preparation part")
    p.add_argument("--max-workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loader-samples", type=int, default=4000, help="windows read per loader measurement")
    p.add_argument("--order-max", type=float, default=1e9, help="largest order size measured (samples)")
    p.add_argument("--train-steps", type=int, default=40, help="steps of each training run (0: skip)")
    p.add_argument("--ckpt-mb", type=float, default=128, help="MB of the checkpoint part's generation")
    p.add_argument("--parts", default="prepare,loader,order,training,checkpoint,litdata", help="comma-separated parts")
    p.add_argument("--json", type=Path, help="also write the JSON object here")
    return p.parse_args(argv)


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


def prepare_run(max_bytes: int, workers: int, work: Path) -> dict:
    out = work / f"prep-{workers}-{time.monotonic_ns()}"
    args = [sys.executable, "-m", "trainer.data", "prepare", "--source", "stdlib", "--include", "*.py", "--out",
            str(out), "--max-bytes", str(max_bytes), "--tokenizer", str(TOKENIZER), "--workers", str(workers),
            "--val-fraction", "0.1"]  # fmt: skip
    one_core = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}  # per worker: one core
    t = time.perf_counter()
    subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True, env=one_core)
    seconds = time.perf_counter() - t
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = sum(manifest["tokens"].values())
    shas = [s["sha256"] for split in manifest["splits"].values() for s in split]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return {"tokens": tokens, "seconds": seconds, "shards_sha256": shas}


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


# ------------------------------------------------------------------------------------------------------- S3
@contextlib.contextmanager
def s3_server():
    """The benchmark's own S3 server (envs/s3/server.sh on PORT, a fresh state folder, wiped afterwards)."""
    state = Path(tempfile.mkdtemp(prefix="hpc-s3-bench-"))
    env = {**os.environ, "HPC_S3_PORT": PORT, "HPC_S3_BUCKETS": "bench"}
    subprocess.run(["bash", "envs/s3/server.sh", "install"], cwd=ROOT, env=env, check=True, capture_output=True)
    subprocess.run(["bash", "envs/s3/server.sh", "start", str(state)], cwd=ROOT, env=env, check=True)
    old = {k: os.environ.get(k) for k in [*CREDENTIALS, "AWS_ENDPOINT_URL"]}
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=f"http://127.0.0.1:{PORT}")
    try:
        yield
    finally:
        subprocess.run(["bash", "envs/s3/server.sh", "wipe", str(state)], cwd=ROOT, env=env, capture_output=True)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def small_dataset(work: Path) -> Path:
    from trainer.data.prepare import PrepareSpec, prepare

    out = work / "data"
    spec = PrepareSpec(source="stdlib", include=("*.py",), max_source_bytes=8_000_000, val_fraction=0.05,
                       shard_tokens=500_000)  # fmt: skip
    prepare(spec, out, workers=2)
    return out


def upload(folder: Path, prefix: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    for path in sorted(folder.iterdir()):
        fs.put_file(str(path), f"bench/{prefix}/{path.name}")
    return f"s3://bench/{prefix}"


def read_windows(shards, count: int, seq_len: int) -> float:
    """Samples/s reading ``count`` windows in the windowed order, announcing the shards ahead as the loader does."""
    from trainer.data.order import WindowedOrder

    order = WindowedOrder(shards.shard_sizes, 1, window=4)
    t = time.perf_counter()
    for position in range(0, count, 64):
        if getattr(shards, "cache", None) is not None:
            shards.will_need(order.blocks_ahead(position, 64, windows_after=1))
        for i in order.take(position, min(64, count - position)):
            shards[int(i)]
    return count / (time.perf_counter() - t)


def part_loader(args, work: Path, data: Path, url: str) -> dict:
    from runconfig.schema import StorageConfig
    from storage.objstore import Store
    from trainer.data.dataset import TokenShards, read_manifest
    from trainer.data.resolve import remote_manifest
    from trainer.data.stream import FETCHES, ShardCache

    seq_len = 256
    manifest = read_manifest(data)
    local = TokenShards(data, manifest, "train", seq_len)
    count = min(args.loader_samples, len(local))
    rates: dict[str, list[float]] = {"local disk": [], "s3, cold cache": [], "s3, warm cache": []}
    fetched = []
    for r in range(args.rounds):
        rates["local disk"].append(read_windows(local, count, seq_len))
        local.close()
        store = Store(StorageConfig())
        remote, sizes = remote_manifest(store, url)
        folder = work / f"cache-{r}"
        for kind in ("s3, cold cache", "s3, warm cache"):
            cache = ShardCache(store, url, remote, folder, max_bytes=0, threads=4, rank=0, sizes=sizes)
            shards = TokenShards(folder, remote, "train", seq_len, cache=cache, check_range=False)
            rates[kind].append(read_windows(shards, count, seq_len))
            shards.close()
            cache.close()
        fetched.append(sum(json.loads(x)["bytes"] for x in (folder / FETCHES).read_text().splitlines()))
    train_bytes = sum((data / s["file"]).stat().st_size for s in manifest["splits"]["train"])
    epoch_share = count / len(local)
    return {
        "samples": count,
        "samples_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "bytes_fetched_per_node": statistics.median(fetched),
        "train_bytes": train_bytes,
        "epoch_share_read": epoch_share,
        "fetched_vs_dataset": statistics.median(fetched) / train_bytes,
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


# -------------------------------------------------------------------------------------------------- checkpoint
def generation(root: Path, mb: float) -> tuple[Path, dict]:
    """A committed generation under ``root``: a DCP save of random tensors and its manifest (sizes, SHA-256)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from rundir.checkpoints import commit
    from storage.digest import sha256_file

    n = max(1, int(mb * 2**20 / 4 / 8))
    state = {f"layer{i}": torch.randn(n) for i in range(8)}
    tmp = root / ".tmp-step_00000001"
    dcp.save(state, checkpoint_id=str(tmp))
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir())}
    commit(tmp, root / "step_00000001", {"step": 1, "world_size": 1, "files": files})
    return root / "step_00000001", state


def part_checkpoint(args, work: Path) -> dict:
    import s3fs
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from runconfig.schema import StorageConfig
    from storage.ioretry import RetryPolicy
    from storage.objstore import Store
    from trainer.checkpoint.agreement import Agreement
    from trainer.checkpoint.remote import RemoteGenerations

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        final, state = generation(work / "ckpt-src", args.ckpt_mb)
        nbytes = sum(p.stat().st_size for p in final.iterdir() if p.name != "manifest.json")
        agreement = Agreement(0, 1, None, RetryPolicy(3, 0.5, "checkpoint.io_retries"))
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        store = Store(StorageConfig())
        store.call(lambda f, p: f.exists(p), "s3://bench/warm", what="warm-up")  # both clients connected first
        fs.exists("bench/warm")
        files = sorted(p for p in final.iterdir() if p.name != "manifest.json")
        times: dict[str, list[float]] = {k: [] for k in
                                         ("save, trainer", "save, raw", "restore, trainer", "restore, raw",
                                          "save, DCP fsspec", "restore, DCP fsspec")}  # fmt: skip
        for r in range(args.rounds):
            url = f"s3://bench/ckpt-{r}"
            remote = RemoteGenerations(store=store, url=url, agreement=agreement,
                                       root=work / f"ckpt-dst-{r}", keep_last=3, keep_every=0)  # fmt: skip
            t = time.perf_counter()
            remote.upload(final, 1)
            times["save, trainer"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for p in files:
                fs.put_file(str(p), f"bench/raw-{r}/{p.name}")
            times["save, raw"].append(time.perf_counter() - t)
            (work / f"ckpt-dst-{r}").mkdir()
            t = time.perf_counter()
            assert remote.fetch_newest(print) == final.name
            times["restore, trainer"].append(time.perf_counter() - t)
            raw = work / f"raw-{r}"
            raw.mkdir()
            t = time.perf_counter()
            for p in files:
                fs.get_file(f"bench/raw-{r}/{p.name}", str(raw / p.name))
            times["restore, raw"].append(time.perf_counter() - t)
            opts = {"thread_count": 4, "sync_files": False, "overwrite": True}
            t = time.perf_counter()
            dcp.save(state, storage_writer=FsspecWriter(f"s3://bench/dcp-{r}", **opts))
            times["save, DCP fsspec"].append(time.perf_counter() - t)
            back = {k: torch.empty_like(v) for k, v in state.items()}
            t = time.perf_counter()
            dcp.load(back, storage_reader=FsspecReader(f"s3://bench/dcp-{r}"))
            times["restore, DCP fsspec"].append(time.perf_counter() - t)
            assert all(torch.equal(back[k], state[k]) for k in state)
            for path in (raw, work / f"ckpt-dst-{r}"):
                subprocess.run(["rm", "-rf", str(path)], check=True)
    finally:
        dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "bytes": nbytes,
        "seconds": med,
        "mb_per_s": {k: nbytes / v / 1e6 for k, v in med.items()},
        "save_vs_raw": med["save, raw"] / med["save, trainer"],
        "restore_vs_raw": med["restore, raw"] / med["restore, trainer"],
    }


# ----------------------------------------------------------------------------------------------------- litdata
def _lit_items(path: str):
    """litdata's optimize: one shard's tokens (the dtype kept) as one item of its TokensLoader."""
    import h5py
    import torch

    with h5py.File(path, "r") as f:
        yield torch.from_numpy(f["tokens"][:])


def part_litdata(args, work: Path, data: Path) -> dict:
    try:
        import litdata
        import litdata.streaming.downloader as downloader
        from litdata import StreamingDataset, optimize
        from litdata.streaming.item_loader import TokensLoader
    except ImportError as exc:
        return {"skipped": f"litdata does not import ({exc}); pip install --no-deps -r envs/requirements-bench.txt"}
    import s3fs

    from trainer.data.dataset import read_manifest

    manifest = read_manifest(data)
    shards = manifest["splits"]["train"]
    chunk = max(s["tokens"] for s in shards)
    local = work / "litdata"
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines
        optimize(fn=_lit_items, inputs=[str(data / s["file"]) for s in shards], output_dir=str(local),
                 chunk_size=chunk, item_loader=TokensLoader(), num_workers=1, start_method="fork")  # fmt: skip
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    for path in sorted(local.iterdir()):
        fs.put_file(str(path), f"bench/litdata/{path.name}")
    # Its fast download path (obstore) refuses a plain-http endpoint; this private option of litdata 0.2.76 allows
    # one (a real deployment's endpoint is https).
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
    options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
    rates: dict[str, list[float]] = {"litdata, cold cache": [], "litdata, warm cache": []}
    fetched = []
    for r in range(args.rounds):
        cache = work / f"litcache-{r}"
        for kind in rates:
            dataset = StreamingDataset("s3://bench/litdata", cache_dir=str(cache), item_loader=TokensLoader(
                block_size=257), shuffle=True, drop_last=True, seed=r, storage_options=options)  # fmt: skip
            count = min(args.loader_samples, len(dataset))
            t = time.perf_counter()
            for n, _ in enumerate(dataset, 1):
                if n >= count:
                    break
            rates[kind].append(count / (time.perf_counter() - t))
        fetched.append(sum(p.stat().st_size for p in cache.rglob("*.bin")))
    return {
        "version": litdata.__version__,
        "samples": count,
        "samples_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "bytes_in_cache": statistics.median(fetched),
    }


# ---------------------------------------------------------------------------------------------------- training
def train_run(work: Path, name: str, sets: list[str]) -> Path:
    run_dir = work / name
    args = [sys.executable, "-m", "hpc.submit", "tiny", "--local", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True)
    return run_dir


def part_training(args, work: Path, data: Path, url: str) -> dict:
    common = [f"train.steps={args.train_steps}", "train.eval_every=0", "checkpoint.every_steps=0",
              "data.shuffle_window=4", "comm.allreduce=flat"]  # fmt: skip
    out = {}
    for name, path in (("local disk", str(data)), ("s3, cold cache", url)):
        cache = work / f"train-cache-{name[:2]}"
        run_dir = train_run(work, name.replace(" ", "_").replace(",", ""), [*common, f"data.path={path}",
                                                                             f"data.cache_dir={cache}"])  # fmt: skip
        rows = lines(run_dir / "metrics.jsonl")[2:]
        downloads = {
            log.parent.parent.name: sum(Counter(x["file"] for x in lines(log)).values())
            for log in cache.glob("*/*/fetches.jsonl")
        }
        out[name] = {
            "time_data_s": statistics.median(r["time_data_s"] for r in rows),
            "step_time_s": statistics.median(r["step_time_s"] for r in rows),
            "downloads_per_node": downloads,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    result: dict = {"parts": sorted(parts)}
    with tempfile.TemporaryDirectory(prefix="hpc-bench-data-") as tmp:
        work = Path(tmp)
        if "prepare" in parts:
            result["prepare"] = part_prepare(args, work)
        if "order" in parts:
            result["order"] = part_order(args)
        if parts & {"loader", "training", "checkpoint", "litdata"}:
            data = small_dataset(work) if parts & {"loader", "training", "litdata"} else None
            with s3_server():
                url = upload(data, "small") if data is not None else ""
                if "loader" in parts:
                    result["loader"] = part_loader(args, work, data, url)
                if "training" in parts and args.train_steps:
                    result["training"] = part_training(args, work, data, url)
                if "litdata" in parts:
                    result["litdata"] = part_litdata(args, work, data)
                if "checkpoint" in parts:
                    result["checkpoint"] = part_checkpoint(args, work)
    show(result)
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
