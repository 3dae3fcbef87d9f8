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
import re
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runconfig.schema import MIN_SHARD_TOKENS, StorageConfig
from rundir.contract import data_cache
from storage.digest import sha256_file
from storage.objstore import Store, StoreError, is_url, join, local_path
from trainer.data.formats import (
    EOS,
    KINDS,
    TOKEN_DTYPES,
    VOCAB_SIZE,
    CorpusError,
    Options,
    is_lengths_file,
    kind_of,
    units,
)
from trainer.data.passes import FORMAT, Plan, cut_parts, parts_done, run_passes
from trainer.data.remote_source import fetch

TOKENIZER = "bytes"
#: The manifest's tokenizer for token files prepared without one.
PRETOKENIZED = "pretokenized"
DTYPE = "uint16"
#: End-of-document tokens looked up in a tokenizer's vocabulary, in this order.
EOS_TOKENS = ("<|eos|>", "<|endoftext|>")
#: Name of the tokenizer's copy in a prepared dataset folder.
TOKENIZER_FILE = "tokenizer.json"
#: Source bytes per part of the parallel preparation (trainer/data/passes.py).
PART_BYTES = 16 << 20
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
    format: str = "auto"
    """How the files are read (trainer/data/formats.py): text, jsonl, parquet, arrow, tokens, or auto (by ending)."""
    field: str = "text"
    """The JSON field or the Parquet / Arrow column that holds each document's text."""
    token_dtype: str | None = None
    """The dtype of raw ``.bin`` token files."""
    vocab_size: int | None = None
    """Token files without a tokenizer: the vocabulary their ids are from."""
    eos: int | None = None
    """Token files without a tokenizer: the end-of-document id (a separator in the files, or added after each
    document a lengths file gives)."""

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
        if self.format not in ("auto", *KINDS):
            out.append(("format", f"must be one of auto, {', '.join(KINDS)}, got {self.format!r}"))
        if not isinstance(self.field, str) or not self.field:
            out.append(("field", f"must name a JSON field or a column, got {self.field!r}"))
        if self.token_dtype is not None and self.token_dtype not in TOKEN_DTYPES:
            out.append(("token_dtype", f"must be one of {', '.join(TOKEN_DTYPES)}, got {self.token_dtype!r}"))
        for name in ("vocab_size", "eos"):
            value = getattr(self, name)
            if value is not None and (_not_int(value) or value < (2 if name == "vocab_size" else 0)):
                out.append((name, f"must be an integer >= {2 if name == 'vocab_size' else 0} or unset, got {value!r}"))
        if self.tokenizer is not None and (self.vocab_size is not None or self.eos is not None):
            out.append(("vocab_size", "and eos come from the tokenizer when one is given; set one or the other"))
        elif self.vocab_size is not None and self.eos is not None and self.eos >= self.vocab_size:
            out.append(("eos", f"must be below vocab_size {self.vocab_size}, got {self.eos}"))
        return out

    def source_dir(self) -> Path:
        return Path(sysconfig.get_paths()["stdlib"]) if self.source == STDLIB else Path(self.source).expanduser()

    def source_name(self) -> str:
        """The source as the key and the manifest name it: a URL as given, a path resolved."""
        return self.source if is_url(self.source) else str(self.source_dir().resolve())

    def tokenizer_path(self) -> Path | None:
        return None if self.tokenizer is None else Path(self.tokenizer).expanduser()

    def key(self) -> str:
        """Identifies the prepared result: same key, same dataset. With a tokenizer its file's SHA-256 is part of
        the key (a changed tokenizer is a new dataset); raises TokenizerError when that file cannot be read."""
        path = self.tokenizer_path()
        tokenizer = TOKENIZER if path is None else f"tokenizers:{tokenizer_sha256(path)}"
        parts = [str(FORMAT), tokenizer, self.source_name(), *self.include]
        parts += [str(self.max_source_bytes), repr(self.val_fraction), str(self.shard_tokens)]
        read = (self.format, self.field, self.token_dtype, self.vocab_size, self.eos)
        if read != ("auto", "text", None, None, None):  # a folder of text files keeps the key it always had
            parts += [repr(read)]
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


def list_files(spec: PrepareSpec, root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of every source file under ``root`` (the spec's source folder), sorted by relative
    path (the source itself when it is a file). A token file's lengths (``NAME.lengths.npy``) are read with it, not
    as a source file of their own."""
    root = root or spec.source_dir()
    if root.is_file():
        return [(root.name, root)]
    top = str(root)
    matchers = [re.compile(fnmatch.translate(pat)).match for pat in spec.include]
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if spec.source == STDLIB:
            dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDE]
        dirnames.sort()
        prefix = os.path.relpath(dirpath, top).replace(os.sep, "/")
        prefix = "" if prefix == "." else prefix + "/"
        for name in filenames:
            rel = prefix + name
            if any(match(rel) or match(name) for match in matchers) and not is_lengths_file(name):
                found[rel] = Path(dirpath, name)
    return sorted(found.items())


def is_val(rel: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return h / 2**64 < val_fraction


def select_files(spec: PrepareSpec, root: Path | None = None) -> list[tuple[str, Path]]:
    """The source files taken, in order: all of them, or the leading ones within max_source_bytes (at least one)."""
    files = list_files(spec, root)
    if not spec.max_source_bytes:
        return files
    taken, total = [], 0
    for rel, path in files:
        size = path.stat().st_size
        if total + size > spec.max_source_bytes and taken:
            break
        taken.append((rel, path))
        total += size
    return taken


def work_folder(out: str | Path, spec: PrepareSpec, cache: Path | None = None) -> Path:
    """Where the passes keep their results until the dataset is complete: beside a local ``out`` (so the shards
    move into it without a copy), else under the data cache; the same for the same preparation, so that a killed
    one resumes there."""
    if not is_url(str(out)):
        out = Path(local_path(str(out)))
        return out.parent / f".{out.name}.prepare-{spec.key()}"
    base = cache or data_cache(os.environ)
    return base / "prepare" / spec.key()


def prepare(
    spec: PrepareSpec,
    out: str | Path,
    *,
    progress: bool = False,
    workers: int = 1,
    part_bytes: int = PART_BYTES,
    task: int = 0,
    tasks: int = 1,
    work: Path | None = None,
    store: Store | None = None,
    on_part: Callable[[int], None] | None = None,
    part_delay_s: float = 0.0,
) -> dict:
    """Prepare ``spec`` into ``out`` (a folder, or an object-storage URL) and return the manifest. The folder
    appears complete or not at all (its manifest is written last; for a URL, uploaded last). An existing complete
    dataset at ``out`` is left alone and its manifest returned. ``workers`` processes (and ``tasks`` Slurm tasks)
    share the work, with the same result whatever their number; a preparation killed part-way continues where it
    stopped when run again (trainer/data/passes.py). Raises TokenizerError (a ValueError) for a tokenizer file that
    is missing or unusable, before any other work. With ``tasks`` > 1 only task 0 writes the dataset; the others
    return None once their share is done."""
    remote = is_url(str(out))
    store = store or Store(StorageConfig())
    existing = _existing_manifest(out, store)
    if existing is not None:
        return existing
    tok_path = spec.tokenizer_path()
    tokenizer = None if tok_path is None else load_tokenizer(tok_path)
    work = work or work_folder(out, spec)
    copy = None
    if is_url(spec.source):  # a copy in the work folder, read as a local one (trainer/data/remote_source.py)
        copy = fetch(spec.source, spec.include, spec.max_source_bytes, work / "source", store, task=task, tasks=tasks)
    root, files = _source_files(spec, copy)
    plan = _plan(spec, files, tokenizer, part_bytes)
    if progress:
        done = parts_done(work, plan)
        again = f", {done} done by an earlier attempt" if done else ""
        print(f"preparing {len(files)} files in {len(plan.parts)} parts{again} with {workers} worker(s) (work "
              f"folder {work})", file=sys.stderr)  # fmt: skip
    splits, read = run_passes(
        plan, work, workers=workers, task=task, tasks=tasks, on_part=on_part, part_delay_s=part_delay_s
    )
    if task != 0:
        return None  # type: ignore[return-value]
    manifest = _manifest(spec, root, plan, tokenizer, splits, read)
    names = [sh["file"] for shards in splits.values() for sh in shards]
    if remote:
        _publish_remote(str(out), work, names, manifest, tokenizer, store)
    else:
        _publish_local(Path(local_path(str(out))), work, names, manifest, tokenizer)
    shutil.rmtree(work, ignore_errors=True)
    return manifest


def _source_files(spec: PrepareSpec, copy: Path | None) -> tuple[Path, list[tuple[str, Path]]]:
    """The source folder (a remote source's local ``copy``) and the files taken from it; FileNotFoundError when
    there is nothing to take."""
    root = copy or spec.source_dir()
    if not root.exists():
        raise FileNotFoundError(f"data source {root} does not exist")
    files = select_files(spec, copy)
    if not files:
        raise FileNotFoundError(f"data source folder {root} has no files matching {list(spec.include)}")
    return root, files


def _plan(spec: PrepareSpec, files: list[tuple[str, Path]], tokenizer: Tokenizer | None, part_bytes: int) -> Plan:
    """What the passes do: the files' units cut into parts of about ``part_bytes``, each text file's split, how the
    files are read and encoded. CorpusError for a token file without a vocabulary or a file that cannot be cut."""
    kinds = tuple(kind_of(rel, spec.format) for rel, _ in files)
    eos, vocab_size, dtype = _vocabulary(spec, files, kinds, tokenizer)
    options = Options(field=spec.field, token_dtype=spec.token_dtype, eos=eos, vocab_size=vocab_size)
    all_units = [(i, *u) for i, ((_, path), kind) in enumerate(zip(files, kinds, strict=True))
                 for u in units(kind, path, part_bytes, options)]  # fmt: skip
    return Plan(
        files=tuple((rel, str(path)) for rel, path in files),
        kinds=kinds,
        parts=tuple(cut_parts(all_units, part_bytes)),
        val=tuple(is_val(rel, spec.val_fraction) for rel, _ in files),
        val_fraction=float(spec.val_fraction),
        options=options,
        shard_tokens=spec.shard_tokens,
        dtype=dtype,
        tokenizer=None if tokenizer is None else str(tokenizer.path),
        eos=eos,
    )


def _vocabulary(
    spec: PrepareSpec, files: list[tuple[str, Path]], kinds: tuple[str, ...], tokenizer: Tokenizer | None
) -> tuple[int, int, str]:
    """(end-of-document id, vocabulary size, dtype of the shards): the tokenizer's, the stated ones of token files,
    or bytes'."""
    if tokenizer is not None:
        return tokenizer.eos_id, tokenizer.vocab_size, tokenizer.dtype
    tokens = [rel for (rel, _), kind in zip(files, kinds, strict=True) if kind == "tokens"]
    if not tokens:
        return EOS, VOCAB_SIZE, DTYPE
    if spec.vocab_size is None or spec.eos is None:
        raise CorpusError(f"{spec.source_dir() / tokens[0]}: token files need their vocabulary: give the tokenizer "
                          "that made them (--tokenizer), or --vocab-size and --eos")  # fmt: skip
    text = [rel for (rel, _), kind in zip(files, kinds, strict=True) if kind != "tokens"]
    if text:
        raise CorpusError(f"{spec.source_dir() / text[0]}: text beside token files would be encoded as bytes, in "
                          "another vocabulary than theirs; give the tokenizer that made the token files")  # fmt: skip
    return spec.eos, spec.vocab_size, "uint16" if spec.vocab_size <= 1 << 16 else "uint32"


def _manifest(spec: PrepareSpec, root: Path, plan: Plan, tokenizer: Tokenizer | None, splits: dict, read: dict) -> dict:
    """The finished dataset's manifest; ValueError when a split came out empty."""
    for split, shards in splits.items():
        if not shards:
            raise ValueError(
                f"the {split} split of {root} came out empty ({read['source_files']} files); use more files or "
                "change data.val_fraction"
            )
    pretokenized = tokenizer is None and "tokens" in plan.kinds
    manifest = {
        "format": FORMAT,
        "tokenizer": TOKENIZER_FILE if tokenizer else PRETOKENIZED if pretokenized else TOKENIZER,
        "vocab_size": plan.options.vocab_size,
        "eos": plan.eos,
        "eos_id": plan.eos,
        "dtype": plan.dtype,
    }
    if tokenizer is not None:
        manifest["tokenizer_sha256"] = tokenizer.sha256
        manifest["tokenizer_source"] = str(tokenizer.path.resolve())
    read_as = {kind: plan.kinds.count(kind) for kind in sorted(set(plan.kinds))}
    manifest |= {
        "source": spec.source if is_url(spec.source) else str(root),
        "source_formats": read_as,
        **({"source_field": spec.field} if {"jsonl", "parquet", "arrow"} & set(read_as) else {}),
        **read,
        "key": spec.key(),
        "splits": splits,
        "tokens": {s: sum(sh["tokens"] for sh in shards) for s, shards in splits.items()},
    }
    return manifest


def _existing_manifest(out: str | Path, store: Store) -> dict | None:
    if not is_url(str(out)):
        path = Path(local_path(str(out))) / "manifest.json"
        return json.loads(path.read_text()) if path.is_file() else None
    try:
        return json.loads(store.read_bytes(join(str(out), "manifest.json"), what="prepared manifest"))
    except StoreError as exc:
        if "no such object" in str(exc):
            return None
        raise


def _publish_local(out: Path, work: Path, names: list[str], manifest: dict, tokenizer: Tokenizer | None) -> None:
    """The shards moved into a fresh sibling folder with the manifest written last, then renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for name in names:
            os.replace(work / "shards" / name, tmp / name)
        if tokenizer is not None:
            shutil.copyfile(tokenizer.path, tmp / TOKENIZER_FILE)
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


def _publish_remote(
    url: str, work: Path, names: list[str], manifest: dict, tokenizer: Tokenizer | None, store: Store
) -> None:
    """Every shard uploaded (those already there at their size skipped: a resumed upload), the manifest last."""
    present = _listing(store, url)

    def upload(name: str) -> None:
        local = work / "shards" / name
        if present.get(name) != local.stat().st_size:
            store.call(lambda fs, p: fs.put_file(str(local), p), join(url, name), what="upload of data shard")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(upload, names))
    if tokenizer is not None:
        store.write_bytes(join(url, TOKENIZER_FILE), tokenizer.path.read_bytes(), what="upload of tokenizer")
    store.write_bytes(join(url, "manifest.json"), (json.dumps(manifest, indent=2) + "\n").encode(),
                      what="upload of manifest")  # fmt: skip


def _listing(store: Store, url: str) -> dict[str, int]:
    """{name: bytes} of what an earlier upload left under ``url`` (one listing); empty when nothing is there."""
    try:
        return store.sizes(url, what="prepared dataset listing of")
    except StoreError:
        return {}
