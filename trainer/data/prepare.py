"""Turn a folder of text files into sharded HDF5 token files with a manifest (numpy + h5py; no torch).

Layout of a prepared dataset folder::

    manifest.json          # written last: the folder is complete only once it exists
    train_00000.h5 ...     # dataset "tokens": 1-D uint16, documents separated by the EOS token
    val_00000.h5 ...       # held-out files (chosen by a hash of their path, so stable as the source grows)

Tokens are bytes (0..255) plus EOS = 256 after every document: vocabulary 257.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from runconfig.digest import sha256_file
from runconfig.schema import MIN_SHARD_TOKENS

FORMAT = 1
TOKENIZER = "bytes"
EOS = 256
VOCAB_SIZE = 257
DTYPE = "uint16"
STDLIB = "stdlib"
#: Folders never taken from the standard library: installed packages differ between machines.
STDLIB_EXCLUDE = ("site-packages", "dist-packages", "__pycache__")


@dataclass(frozen=True, kw_only=True)
class PrepareSpec:
    source: str
    include: tuple[str, ...]
    max_source_bytes: int
    val_fraction: float
    shard_tokens: int

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(f"{name} {what}" for name, what in problems))

    def problems(self) -> list[tuple[str, str]]:
        """(field, what is wrong) for every out-of-range field; checked before any work is done."""
        out = []
        if not self.include:
            out.append(("include", "needs at least one pattern"))
        if _not_int(self.max_source_bytes) or self.max_source_bytes < 0:
            out.append(("max_source_bytes", f"must be an integer >= 0, got {self.max_source_bytes!r}"))
        fraction = self.val_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 < fraction < 1.0:
            out.append(("val_fraction", f"must be a number in (0, 1), got {self.val_fraction!r}"))
        if _not_int(self.shard_tokens) or self.shard_tokens < MIN_SHARD_TOKENS:
            out.append(("shard_tokens", f"must be an integer >= {MIN_SHARD_TOKENS}, got {self.shard_tokens!r}"))
        return out

    def source_dir(self) -> Path:
        return Path(sysconfig.get_paths()["stdlib"]) if self.source == STDLIB else Path(self.source).expanduser()

    def key(self) -> str:
        """Identifies the prepared result: same key, same dataset."""
        parts = [str(FORMAT), TOKENIZER, str(self.source_dir().resolve()), *self.include]
        parts += [str(self.max_source_bytes), repr(self.val_fraction), str(self.shard_tokens)]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int | np.integer)


def list_files(spec: PrepareSpec) -> list[tuple[str, Path]]:
    """(relative path, path) of every source file, sorted by relative path."""
    root = spec.source_dir()
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if spec.source == STDLIB:
            dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDE]
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if any(fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(name, pat) for pat in spec.include):
                found[rel] = path
    return sorted(found.items())


def is_val(rel: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return h / 2**64 < val_fraction


class _ShardWriter:
    def __init__(self, folder: Path, split: str, shard_tokens: int) -> None:
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_len = 0
        self.shards: list[dict] = []

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(tokens)
        self.pending_len += len(tokens)
        while self.pending_len >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def close(self) -> list[dict]:
        if self.pending_len:
            self._flush(self.pending_len)
        return self.shards

    def _flush(self, count: int) -> None:
        joined = np.concatenate(self.pending)
        head, rest = joined[:count], joined[count:]
        self.pending, self.pending_len = ([rest] if len(rest) else []), len(rest)
        name = f"{self.split}_{len(self.shards):05d}.h5"
        path = self.folder / name
        with h5py.File(path, "w") as f:
            f.create_dataset("tokens", data=head, dtype=DTYPE)
            f.attrs["format"] = FORMAT
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
        self.shards.append({"file": name, "tokens": int(len(head)), "sha256": sha256_file(path)})


def prepare(spec: PrepareSpec, out: Path, *, progress: bool = False) -> dict:
    """Prepare ``spec`` into ``out`` atomically (a temporary sibling folder renamed into place) and return the
    manifest. An existing complete dataset at ``out`` is left alone and its manifest returned."""
    out = Path(out)
    if (out / "manifest.json").is_file():
        return json.loads((out / "manifest.json").read_text())
    root = spec.source_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"data source folder {root} does not exist")
    files = list_files(spec)
    if not files:
        raise FileNotFoundError(f"data source folder {root} has no files matching {list(spec.include)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        writers = {s: _ShardWriter(tmp, s, spec.shard_tokens) for s in ("train", "val")}
        source_hash = hashlib.sha256()
        total_bytes = 0
        bar = _progress(len(files), progress)
        taken = 0
        for rel, path in files:
            data = path.read_bytes()
            if spec.max_source_bytes and total_bytes + len(data) > spec.max_source_bytes and taken:
                break
            source_hash.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
            tokens = np.empty(len(data) + 1, dtype=np.uint16)
            tokens[:-1] = np.frombuffer(data, dtype=np.uint8)
            tokens[-1] = EOS
            writers["val" if is_val(rel, spec.val_fraction) else "train"].add(tokens)
            total_bytes += len(data)
            taken += 1
            bar.update(1)
        bar.close()
        splits = {s: w.close() for s, w in writers.items()}
        for split, shards in splits.items():
            if not shards:
                raise ValueError(
                    f"the {split} split of {root} came out empty ({taken} files); use more files or change "
                    "data.val_fraction"
                )
        manifest = {
            "format": FORMAT,
            "tokenizer": TOKENIZER,
            "vocab_size": VOCAB_SIZE,
            "eos": EOS,
            "dtype": DTYPE,
            "source": str(root),
            "source_files": taken,
            "source_bytes": total_bytes,
            "source_sha256": source_hash.hexdigest(),
            "key": spec.key(),
            "splits": splits,
            "tokens": {s: sum(sh["tokens"] for sh in shards) for s, shards in splits.items()},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "manifest.json").is_file():  # somebody else finished first: fine; else a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return json.loads((out / "manifest.json").read_text())


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _Silent()
    from tqdm import tqdm

    return tqdm(total=total, unit="file", desc="tokenizing", file=sys.stderr, disable=not sys.stderr.isatty())
