"""Preparation in two passes over a work folder, in parallel over processes (and Slurm tasks), resumable.

Pass 1 cuts the source files into *parts* (consecutive units of files, about ``part_bytes`` each: a text file, a
byte range of JSON lines, a Parquet row group, a token range; trainer/data/formats.py) and tokenizes each part on its
own into one raw token file per split (``parts/P.train.bin``, ``parts/P.val.bin``) and a record of its
counts and file digests (``parts/P.json``, written last). Pass 2 cuts the concatenation of the parts' streams into
shards of ``shard_tokens`` (shard k of a split is tokens [k*S, (k+1)*S) of its stream) and writes each shard from
the slices of the parts it spans (``shards/NAME.h5`` and ``shards/NAME.json``). Every file is written under a
temporary name and renamed, so a part or shard that exists is complete: a killed preparation run again with the
same work folder does only what is missing. The shards are the ones one process writing the whole stream would
write, byte for byte, whatever the number of workers or tasks.

Tasks (``task``, ``tasks``: Slurm's SLURM_PROCID / SLURM_NTASKS, one per node) take parts and shards i with
i % tasks == task, each over its own worker processes, and wait for each other's records between the passes; the
work folder must then be on a file system every task sees.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from storage.digest import sha256_file
from storage.files import write_atomic
from trainer.data.formats import Options, documents, is_val

FORMAT = 1  # of prepared datasets (the manifest's "format"; the shards' "format" attribute)
#: Documents (or source bytes) encoded per batch when a tokenizer is used.
ENCODE_BATCH_FILES = 256
ENCODE_BATCH_BYTES = 8 << 20
SPLITS = ("train", "val")
_SUM_MOD = 1 << 128


@dataclass(frozen=True)
class Plan:
    """What the passes do: the same plan, the same work folder content (a changed one starts afresh)."""

    files: tuple[tuple[str, str], ...]  # (relative path, path), in order
    kinds: tuple[str, ...]  # per file: text, jsonl, parquet, arrow or tokens (trainer/data/formats.py)
    parts: tuple[tuple[tuple[int, int, int], ...], ...]  # per part, its units: (file, lo, hi)
    val: tuple[bool, ...]  # per file: a text file's split (the other kinds decide per document)
    val_fraction: float
    options: Options
    shard_tokens: int
    dtype: str
    tokenizer: str | None  # path of the tokenizer.json; None: bytes
    eos: int

    def digest(self) -> str:
        text = json.dumps([self.files, self.kinds, self.parts, self.val, self.val_fraction, repr(self.options),
                           self.shard_tokens, self.dtype, self.tokenizer, self.eos])  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def cut_parts(units: list[tuple[int, int, int, int]], part_bytes: int) -> list[tuple[tuple[int, int, int], ...]]:
    """Consecutive runs of units (file, lo, hi, bytes) of about ``part_bytes`` each (a larger unit is a part of its
    own)."""
    parts, current, total = [], [], 0
    for file, lo, hi, size in units:
        current.append((file, lo, hi))
        total += size
        if total >= part_bytes:
            parts.append(tuple(current))
            current, total = [], 0
    if current:
        parts.append(tuple(current))
    return parts


def run_passes(
    plan: Plan,
    work: Path,
    *,
    workers: int,
    task: int = 0,
    tasks: int = 1,
    on_part: Callable[[int], None] | None = None,
    poll_s: float = 0.5,
    part_delay_s: float = 0.0,
) -> tuple[dict[str, list[dict]], dict]:
    """Run both passes (this task's share). Task 0 returns ({split: shard records}, {source_files, source_bytes,
    source_sha256}) once every task's share is done; the others return empty ones after their own. ``on_part(p)``
    runs after each part this task completes; ``part_delay_s`` slows each part (tests: HPC_INJECT slow_part)."""
    work.mkdir(parents=True, exist_ok=True)
    _claim(work, plan)
    (work / "parts").mkdir(exist_ok=True)
    (work / "shards").mkdir(exist_ok=True)
    mine = [p for p in range(len(plan.parts)) if p % tasks == task and not (work / "parts" / f"{p:05d}.json").exists()]
    for p in _parallel(_tokenize_part, [(plan, work, p, part_delay_s) for p in mine], workers):
        if on_part is not None:
            on_part(p)
    records = [_wait_for(work / "parts" / f"{p:05d}.json", poll_s) for p in range(len(plan.parts))]
    jobs = []
    for split in SPLITS:
        total = sum(r["tokens"][split] for r in records)
        for k in range((total + plan.shard_tokens - 1) // plan.shard_tokens):
            jobs.append((split, k, min(plan.shard_tokens, total - k * plan.shard_tokens)))
    todo = [
        (plan, work, records, split, k, n)
        for i, (split, k, n) in enumerate(jobs)
        if i % tasks == task and not (work / "shards" / f"{split}_{k:05d}.json").exists()
    ]
    for _ in _parallel(_write_shard, todo, workers):
        pass
    if task != 0:
        return {}, {}  # task 0 collects the records (and removes the work folder once the dataset is written)
    shards: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for split, k, _ in jobs:
        shards[split].append(_wait_for(work / "shards" / f"{split}_{k:05d}.json", poll_s))
    digest = hashlib.sha256()
    sums: dict[str, int] = {}  # a record file's: the sum of its documents' hashes, whatever cut them into units
    for r in records:
        for rel, value in r.get("sums", ()):
            sums[rel] = (sums.get(rel, 0) + int(value, 16)) % _SUM_MOD
    for r in records:
        for rel, sha in r["digests"]:
            digest.update(rel.encode() + b"\0" + bytes.fromhex(sha))
    for rel, _ in plan.files:
        if rel in sums:
            digest.update(rel.encode() + b"\0" + sums[rel].to_bytes(16, "big"))
    read = {
        "source_files": len(plan.files),
        "documents": {split: sum(r["documents"][split] for r in records) for split in SPLITS},
        "source_bytes": sum(r["bytes"] for r in records),
        "source_sha256": digest.hexdigest(),
    }
    return shards, read


def parts_done(work: Path, plan: Plan) -> int:
    """How many parts of ``plan`` an earlier attempt completed in ``work``."""
    try:
        if json.loads((work / "plan.json").read_text())["plan"] != plan.digest():
            return 0
    except (OSError, ValueError, KeyError):
        return 0
    return len(list((work / "parts").glob("*.json")))


def _claim(work: Path, plan: Plan) -> None:
    """The work folder holds this plan's results, or none: another plan's are removed first."""
    marker = work / "plan.json"
    want = plan.digest()
    try:
        if json.loads(marker.read_text())["plan"] == want:
            return
    except (OSError, ValueError, KeyError):
        pass
    for sub in ("parts", "shards"):
        for f in (work / sub).glob("*") if (work / sub).is_dir() else ():
            f.unlink(missing_ok=True)
    write_atomic(marker, json.dumps({"plan": want}).encode(), fsync=True)


def _parallel(fn: Callable, jobs: list[tuple], workers: int) -> Iterable:
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield fn(*job)
        return
    ctx = multiprocessing.get_context("spawn")  # no state inherited from the caller (threads, open files)
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx, initializer=_quiet_worker) as pool:
        futures = [pool.submit(fn, *job) for job in jobs]
        for future in futures:
            yield future.result()


def _quiet_worker() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the workers are the parallelism


def _wait_for(path: Path, poll_s: float) -> dict:
    while True:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            time.sleep(poll_s)  # another task's share, not done yet


_TOKENIZERS: dict[str, object] = {}


def _encoder(path: str):
    enc = _TOKENIZERS.get(path)
    if enc is None:
        import tokenizers

        enc = _TOKENIZERS[path] = tokenizers.Tokenizer.from_file(path)
    return enc


def _tokenize_part(plan: Plan, work: Path, p: int, delay_s: float = 0.0) -> int:
    """Pass 1 for part ``p``: its documents' tokens, each followed by EOS, appended to its split's stream."""
    time.sleep(delay_s)
    out = {s: open(work / "parts" / f".{p:05d}.{s}.bin.tmp", "wb") for s in SPLITS}  # noqa: SIM115
    counts = dict.fromkeys(SPLITS, 0)
    docs = dict.fromkeys(SPLITS, 0)
    digests: list[tuple[str, str]] = []
    sums: list[tuple[str, str]] = []
    nbytes = 0
    for batch in _read_ahead(_batches(plan, plan.parts[p], digests, sums)):
        for (split, data), tokens in zip(batch, _tokens([d for _, d in batch], plan), strict=True):
            out[split].write(tokens.tobytes())
            counts[split] += len(tokens)
            docs[split] += 1
            nbytes += data.nbytes if isinstance(data, np.ndarray) else len(data)
    for split, f in out.items():
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(work / "parts" / f".{p:05d}.{split}.bin.tmp", work / "parts" / f"{p:05d}.{split}.bin")
    record = {"part": p, "tokens": counts, "documents": docs, "bytes": nbytes, "digests": digests, "sums": sums}
    write_atomic(work / "parts" / f"{p:05d}.json", json.dumps(record).encode(), fsync=True)
    return p


def _batches(plan: Plan, units: tuple, digests: list, sums: list) -> Iterable[list[tuple[str, bytes | np.ndarray]]]:
    """The units' documents, each with its split, in batches of ENCODE_BATCH_FILES / _BYTES. A text file's SHA-256
    goes into ``digests``; a unit of a record file adds the sum of its documents' hashes (each of its key and bytes)
    to ``sums``, which add up to the same for the file however it was cut."""
    batch: list[tuple[str, bytes | np.ndarray]] = []
    batch_bytes = 0
    for i, lo, hi in units:
        rel, path = plan.files[i]
        kind = plan.kinds[i]
        digest, total = hashlib.sha256(), 0
        for key, data in documents(kind, Path(path), lo, hi, plan.options):
            raw = data if isinstance(data, bytes) else data.tobytes()
            if kind == "text":
                digest.update(raw)
            else:
                total += int.from_bytes(hashlib.blake2b(b"%d\0" % key + raw, digest_size=16).digest(), "big")
            val = plan.val[i] if kind == "text" else is_val(rel, key, plan.val_fraction)
            batch.append(("val" if val else "train", data))
            batch_bytes += len(raw)
            if len(batch) >= ENCODE_BATCH_FILES or batch_bytes >= ENCODE_BATCH_BYTES:
                yield batch
                batch, batch_bytes = [], 0
        if kind == "text":
            digests.append((rel, digest.hexdigest()))
        else:
            sums.append((rel, f"{total % _SUM_MOD:032x}"))
    if batch:
        yield batch


def _read_ahead(batches: Iterable[list]) -> Iterable[list]:
    """The next batch read (a thread) while the current one is encoded: the tokenizer releases the GIL, and on a
    parallel file system the reads are mostly waits. An error reading is raised here, in order."""
    ahead: queue.Queue = queue.Queue(maxsize=1)
    done = object()

    def reader() -> None:
        try:
            for batch in batches:
                ahead.put(batch)
            ahead.put(done)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the consumer)
            ahead.put(exc)

    thread = threading.Thread(target=reader, name="prepare-read", daemon=True)
    thread.start()
    while (item := ahead.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item
    thread.join()


def _tokens(documents: list[bytes | np.ndarray], plan: Plan) -> list[np.ndarray]:
    """Each document's tokens followed by the end-of-document token (token documents have it already)."""
    out: list[np.ndarray | None] = [d.astype(plan.dtype) if isinstance(d, np.ndarray) else None for d in documents]
    texts = [(i, d) for i, d in enumerate(documents) if not isinstance(d, np.ndarray)]
    if plan.tokenizer is None:
        for i, data in texts:
            tokens = np.empty(len(data) + 1, dtype=np.uint16)
            tokens[:-1] = np.frombuffer(data, dtype=np.uint8)
            tokens[-1] = plan.eos
            out[i] = tokens
    elif texts:
        encoder = _encoder(plan.tokenizer)
        encode = getattr(encoder, "encode_batch_fast", None) or encoder.encode_batch
        encoded = encode([d.decode("utf-8", errors="replace") for _, d in texts], add_special_tokens=False)
        for (i, _), e in zip(texts, encoded, strict=True):
            out[i] = np.array(e.ids + [plan.eos], dtype=plan.dtype)
    return out  # type: ignore[return-value]


def _write_shard(plan: Plan, work: Path, records: list[dict], split: str, k: int, n: int) -> None:
    """Pass 2 for shard ``k`` of ``split``: tokens [k*S, k*S + n) of the split's stream, from the parts it spans."""
    begin = k * plan.shard_tokens
    pieces, offset = [], 0
    for r in records:
        count = r["tokens"][split]
        lo, hi = max(begin, offset), min(begin + n, offset + count)
        if lo < hi:
            part = np.memmap(work / "parts" / f"{r['part']:05d}.{split}.bin", dtype=plan.dtype, mode="r")
            pieces.append(np.asarray(part[lo - offset : hi - offset]))
        offset += count
    tokens = np.concatenate(pieces) if pieces else np.empty(0, dtype=plan.dtype)
    name = f"{split}_{k:05d}.h5"
    tmp = work / "shards" / f".{name}.tmp-{os.getpid()}"
    with h5py.File(tmp, "w") as f:
        f.create_dataset("tokens", data=tokens, dtype=plan.dtype)
        f.attrs["format"] = FORMAT
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, work / "shards" / name)
    record = {"file": name, "tokens": int(len(tokens)), "sha256": sha256_file(work / "shards" / name)}
    record["bytes"] = (work / "shards" / name).stat().st_size
    write_atomic(work / "shards" / f"{split}_{k:05d}.json", json.dumps(record).encode(), fsync=True)
