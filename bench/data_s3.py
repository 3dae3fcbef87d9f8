"""bench/data.py's parts that read from its own S3 server (envs/s3/server.sh): the loader from local disk and from
the bucket, the tiny model trained from both, checkpoints to and from the bucket, and litdata on the same tokens
(bench/README.md)."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from common import ROOT, lines  # bench/ is on sys.path

PORT = os.environ.get("HPC_BENCH_S3_PORT", "19200")
SEQ_LEN = 256  # windows of 257 tokens, for this package's loader and litdata's alike
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_DEFAULT_REGION": "us-east-1"}


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


def read_windows(shards, count: int) -> float:
    """Samples/s reading ``count`` windows in the windowed order, 64 at a time, announcing the shards ahead when they
    change, as the loader does (trainer/data/loader.py)."""
    from trainer.data.order import WindowedOrder

    order = WindowedOrder(shards.shard_sizes, 1, window=4)
    hinted = None
    t = time.perf_counter()
    for position in range(0, count, 64):
        if getattr(shards, "cache", None) is not None:
            blocks = order.blocks_ahead(position, 64, windows_after=1)
            if blocks != hinted:
                hinted = blocks
                shards.will_need(blocks)
        for i in order.take(position, min(64, count - position)):
            shards[int(i)]
    return count / (time.perf_counter() - t)


class Loader:
    """The loader part: windows read from local disk, then from the bucket through a cold and a warm node cache;
    one round per ``round`` call (alternated with litdata's by bench/data.py), medians from ``result``."""

    def __init__(self, args, work: Path, data: Path, url: str) -> None:
        from trainer.data.dataset import TokenShards, read_manifest

        self.work, self.data, self.url = work, data, url
        self.manifest = read_manifest(data)
        self.local = TokenShards(data, self.manifest, "train", SEQ_LEN)
        self.count = min(args.loader_samples, len(self.local))
        self.rates: dict[str, list[float]] = {"local disk": [], "s3, cold cache": [], "s3, warm cache": []}
        self.fetched: list[int] = []

    def round(self, r: int) -> None:
        from runconfig.schema import StorageConfig
        from storage.objstore import Store
        from trainer.data.dataset import TokenShards
        from trainer.data.node_cache import FETCHES, NodeCache
        from trainer.data.resolve import remote_manifest

        self.rates["local disk"].append(read_windows(self.local, self.count))
        self.local.close()
        store = Store(StorageConfig())
        remote, sizes = remote_manifest(store, self.url)
        folder = self.work / f"cache-{r}"
        for kind in ("s3, cold cache", "s3, warm cache"):
            cache = NodeCache(store, self.url, remote, folder, max_bytes=0, threads=4, rank=0, sizes=sizes)
            shards = TokenShards(folder, remote, "train", SEQ_LEN, cache=cache, check_range=False)
            self.rates[kind].append(read_windows(shards, self.count))
            shards.close()
            cache.close()
        self.fetched.append(sum(json.loads(x)["bytes"] for x in (folder / FETCHES).read_text().splitlines()))

    def result(self) -> dict:
        train_bytes = sum((self.data / s["file"]).stat().st_size for s in self.manifest["splits"]["train"])
        fetched = statistics.median(self.fetched)
        return {
            "samples": self.count,
            "samples_per_s": {k: statistics.median(v) for k, v in self.rates.items()},
            "bytes_fetched_per_node": fetched,
            "train_bytes": train_bytes,
            "epoch_share_read": self.count / len(self.local),
            "fetched_vs_dataset": fetched / train_bytes,
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


class Litdata:
    """The litdata part: the loader part's tokens converted by its ``optimize`` and uploaded to the same server, then
    read with a cold and a warm cache; one round per ``round`` call, medians from ``result``. ``skipped`` says why
    where litdata does not import."""

    def __init__(self, args, work: Path, data: Path) -> None:
        self.work, self.loader_samples = work, args.loader_samples
        self.rates: dict[str, list[float]] = {"litdata, cold cache": [], "litdata, warm cache": []}
        self.fetched: list[int] = []
        self.count = 0
        try:
            import litdata
            import litdata.streaming.downloader as downloader
            from litdata import optimize
            from litdata.streaming.item_loader import TokensLoader
        except ImportError as exc:
            self.skipped = f"litdata does not import ({exc}); pip install --no-deps -r envs/requirements-bench.txt"
            return
        import s3fs

        from trainer.data.dataset import read_manifest

        self.skipped, self.version = "", litdata.__version__
        shards = read_manifest(data)["splits"]["train"]
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

    def round(self, r: int) -> None:
        if self.skipped:
            return
        from litdata import StreamingDataset
        from litdata.streaming.item_loader import TokensLoader

        options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
        cache = self.work / f"litcache-{r}"
        for kind in self.rates:
            dataset = StreamingDataset("s3://bench/litdata", cache_dir=str(cache), item_loader=TokensLoader(
                block_size=SEQ_LEN + 1), shuffle=True, drop_last=True, seed=r, storage_options=options)  # fmt: skip
            self.count = count = min(self.loader_samples, len(dataset))
            t = time.perf_counter()
            for n, _ in enumerate(dataset, 1):
                if n >= count:
                    break
            self.rates[kind].append(count / (time.perf_counter() - t))
        self.fetched.append(sum(p.stat().st_size for p in cache.rglob("*.bin")))

    def result(self) -> dict:
        if self.skipped:
            return {"skipped": self.skipped}
        return {
            "version": self.version,
            "samples": self.count,
            "samples_per_s": {k: statistics.median(v) for k, v in self.rates.items()},
            "bytes_in_cache": statistics.median(self.fetched),
        }
