"""Turn a folder of text files into sharded HDF5 token files with a manifest (numpy + h5py; no torch).

Layout of a prepared dataset folder::

    manifest.json          # written last: the folder is complete only once it exists
    train_00000.h5 ...     # dataset "tokens": 1-D uint16, documents separated by the EOS token
    val_00000.h5 ...       # held-out files (chosen by a hash of their path, so stable as the source grows)

Tokens are bytes (0..255) plus EOS = 256 after every document: vocabulary 257. With a tokenizer (a ``tokenizers``
package ``tokenizer.json``: ``PrepareSpec.tokenizer``, ``data.tokenizer``, ``--tokenizer``) each document's text is
encoded with it instead, followed by the tokenizer's own end-of-document token (``<|eos|>`` or ``<|endoftext|>``);
the vocabulary is the tokenizer's, the dtype uint16 when it fits, else uint32, and a copy of the tokenizer is kept
next to the manifest (``tokenizer.json``) so the ids can be decoded later.
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
from typing import Any

import h5py
import numpy as np

from runconfig.digest import sha256_file
from runconfig.schema import MIN_SHARD_TOKENS

FORMAT = 1
TOKENIZER = "bytes"
EOS = 256
VOCAB_SIZE = 257
DTYPE = "uint16"
#: End-of-document tokens looked up in a tokenizer's vocabulary, in this order.
EOS_TOKENS = ("<|eos|>", "<|endoftext|>")
#: Name of the tokenizer's copy in a prepared dataset folder.
TOKENIZER_FILE = "tokenizer.json"
#: Documents (or source bytes) encoded per batch when a tokenizer is used.
ENCODE_BATCH_FILES = 256
ENCODE_BATCH_BYTES = 8 << 20
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
    tokenizer: str | None = None
    """A ``tokenizers`` tokenizer.json; None: bytes (vocabulary 257)."""

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
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            out.append(("tokenizer", f"must be the path of a tokenizer.json or None, got {self.tokenizer!r}"))
        return out

    def source_dir(self) -> Path:
        return Path(sysconfig.get_paths()["stdlib"]) if self.source == STDLIB else Path(self.source).expanduser()

    def tokenizer_path(self) -> Path | None:
        return None if self.tokenizer is None else Path(self.tokenizer).expanduser()

    def key(self) -> str:
        """Identifies the prepared result: same key, same dataset. With a tokenizer its file's SHA-256 is part of
        the key (a changed tokenizer is a new dataset); raises TokenizerError when that file cannot be read."""
        path = self.tokenizer_path()
        tokenizer = TOKENIZER if path is None else f"tokenizers:{tokenizer_sha256(path)}"
        parts = [str(FORMAT), tokenizer, str(self.source_dir().resolve()), *self.include]
        parts += [str(self.max_source_bytes), repr(self.val_fraction), str(self.shard_tokens)]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


class TokenizerError(ValueError):
    """A tokenizer file that is missing, unreadable or unusable; the message names the file."""


def tokenizer_sha256(path: Path) -> str:
    try:
        return sha256_file(path)
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file {path} does not exist") from None
    except OSError as exc:
        raise TokenizerError(f"tokenizer file {path} cannot be read: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class Tokenizer:
    """A loaded ``tokenizers`` tokenizer and what a prepared dataset records about it."""

    path: Path
    sha256: str
    encoder: Any  # tokenizers.Tokenizer
    eos_id: int
    vocab_size: int

    @property
    def dtype(self) -> str:
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens added: the EOS is appended by the caller)."""
        encode = getattr(self.encoder, "encode_batch_fast", None) or self.encoder.encode_batch
        return [e.ids for e in encode(texts, add_special_tokens=False)]


def load_tokenizer(path: Path) -> Tokenizer:
    """Read a tokenizer.json with the ``tokenizers`` package (imported only here); TokenizerError if it cannot."""
    path = Path(path)
    sha = tokenizer_sha256(path)
    hint = "expected a tokenizer.json written by the `tokenizers` package (Tokenizer.save)"
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(
            f"tokenizer file {path} needs the `tokenizers` package, which is not installed (pip install tokenizers)"
        ) from None
    try:
        encoder = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        detail = " ".join(str(exc).split())[:300]
        raise TokenizerError(f"tokenizer file {path} is not a valid tokenizer ({detail}); {hint}") from None
    vocab = encoder.get_vocab(with_added_tokens=True)
    eos = next((t for t in EOS_TOKENS if t in vocab), None)
    if eos is None:
        raise TokenizerError(
            f"tokenizer file {path} has no end-of-document token: none of {' or '.join(EOS_TOKENS)} is in its "
            "vocabulary (add one as a special token when training the tokenizer)"
        )
    vocab_size = max(encoder.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
    if vocab_size > 1 << 32:
        raise TokenizerError(f"tokenizer file {path} has {vocab_size} tokens, more than uint32 ids can hold")
    return Tokenizer(path=path, sha256=sha, encoder=encoder, eos_id=int(vocab[eos]), vocab_size=int(vocab_size))


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
    def __init__(self, folder: Path, split: str, shard_tokens: int, dtype: str = DTYPE) -> None:
        self.folder, self.split, self.shard_tokens, self.dtype = folder, split, shard_tokens, dtype
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
            f.create_dataset("tokens", data=head, dtype=self.dtype)
            f.attrs["format"] = FORMAT
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
        shard = {"file": name, "tokens": int(len(head)), "sha256": sha256_file(path), "bytes": path.stat().st_size}
        self.shards.append(shard)


def prepare(spec: PrepareSpec, out: Path, *, progress: bool = False) -> dict:
    """Prepare ``spec`` into ``out`` atomically (a temporary sibling folder renamed into place) and return the
    manifest. An existing complete dataset at ``out`` is left alone and its manifest returned. Raises
    TokenizerError (a ValueError) for a tokenizer file that is missing or unusable, before any other work."""
    out = Path(out)
    if (out / "manifest.json").is_file():
        return json.loads((out / "manifest.json").read_text())
    tok_path = spec.tokenizer_path()
    tokenizer = None if tok_path is None else load_tokenizer(tok_path)
    root = spec.source_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"data source folder {root} does not exist")
    files = list_files(spec)
    if not files:
        raise FileNotFoundError(f"data source folder {root} has no files matching {list(spec.include)}")
    dtype = DTYPE if tokenizer is None else tokenizer.dtype
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        splits, read = _write_shards(spec, files, tokenizer, dtype, tmp, progress)
        for split, shards in splits.items():
            if not shards:
                raise ValueError(
                    f"the {split} split of {root} came out empty ({read['source_files']} files); use more files or "
                    "change data.val_fraction"
                )
        manifest = {
            "format": FORMAT,
            "tokenizer": TOKENIZER if tokenizer is None else TOKENIZER_FILE,
            "vocab_size": VOCAB_SIZE if tokenizer is None else tokenizer.vocab_size,
            "eos": EOS if tokenizer is None else tokenizer.eos_id,
            "eos_id": EOS if tokenizer is None else tokenizer.eos_id,
            "dtype": dtype,
        }
        if tokenizer is not None:
            shutil.copyfile(tokenizer.path, tmp / TOKENIZER_FILE)
            manifest["tokenizer_sha256"] = tokenizer.sha256
            manifest["tokenizer_source"] = str(tokenizer.path.resolve())
        manifest |= {
            "source": str(root),
            **read,
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


def _write_shards(
    spec: PrepareSpec, files: list, tokenizer: Tokenizer | None, dtype: str, tmp: Path, progress: bool
) -> tuple[dict, dict]:
    """Read the source files in order (up to max_source_bytes), tokenize them in batches and write each into the
    train or val shards of ``tmp``: ({split: shards}, the manifest's source_files, source_bytes, source_sha256)."""
    writers = {s: _ShardWriter(tmp, s, spec.shard_tokens, dtype) for s in ("train", "val")}
    source_hash = hashlib.sha256()
    total_bytes = 0
    bar = _progress(len(files), progress)
    taken = 0
    batch: list[tuple[str, bytes]] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch_bytes
        for (rel, _), tokens in zip(batch, _tokenize([data for _, data in batch], tokenizer, dtype), strict=True):
            writers["val" if is_val(rel, spec.val_fraction) else "train"].add(tokens)
        bar.update(len(batch))
        batch.clear()
        batch_bytes = 0

    for rel, path in files:
        data = path.read_bytes()
        if spec.max_source_bytes and total_bytes + len(data) > spec.max_source_bytes and taken:
            break
        source_hash.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        batch.append((rel, data))
        batch_bytes += len(data)
        total_bytes += len(data)
        taken += 1
        if len(batch) >= ENCODE_BATCH_FILES or batch_bytes >= ENCODE_BATCH_BYTES:
            flush()
    flush()
    bar.close()
    splits = {s: w.close() for s, w in writers.items()}
    return splits, {"source_files": taken, "source_bytes": total_bytes, "source_sha256": source_hash.hexdigest()}


def _tokenize(documents: list[bytes], tokenizer: Tokenizer | None, dtype: str) -> list[np.ndarray]:
    """Each document's tokens followed by the end-of-document token."""
    if tokenizer is None:
        out = []
        for data in documents:
            tokens = np.empty(len(data) + 1, dtype=np.uint16)
            tokens[:-1] = np.frombuffer(data, dtype=np.uint8)
            tokens[-1] = EOS
            out.append(tokens)
        return out
    texts = [data.decode("utf-8", errors="replace") for data in documents]
    return [np.array([*ids, tokenizer.eos_id], dtype=dtype) for ids in tokenizer.encode(texts)]


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
