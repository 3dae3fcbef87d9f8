"""The corpora ``prepare`` reads, cut into units that a part of the work reads on its own, each read as documents.

- ``text``: a file is a document (its bytes).
- ``jsonl``: a JSON object per line, the document its string field ``field``. Plain files are cut into byte ranges
  at line ends (a line belongs to the range its first byte is in); ``.gz`` and ``.zst`` files are read whole, as a
  compressed stream cannot be entered in the middle.
- ``parquet``: a row per document, the string column ``field``; a unit per row group.
- ``arrow``: Arrow IPC files or streams (``datasets``' ``save_to_disk`` writes streams, ``data-*.arrow``), the
  string column ``field``; a unit per file.
- ``tokens``: token ids already encoded, ``.npy`` arrays or raw ``.bin`` files (their dtype stated), documents
  separated by the end-of-document id, or given by a ``NAME.lengths.npy`` of document lengths beside the file (the
  id then added after each). Cut into token ranges at document starts.

A document's key (its line's byte offset, its line or row number, its first token's index) decides its split
(``is_val``), so the split is the same however the work is cut. Errors are CorpusError, naming the file and the
line, row or token at fault.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KINDS = ("text", "jsonl", "parquet", "arrow", "tokens")
#: File-name endings of each kind, for ``format: auto`` (anything else is text).
SUFFIXES = {
    "jsonl": (".jsonl", ".ndjson", ".json", ".jsonl.gz", ".ndjson.gz", ".json.gz", ".jsonl.zst", ".ndjson.zst",
              ".json.zst"),
    "parquet": (".parquet",),
    "arrow": (".arrow",),
    "tokens": (".npy", ".bin"),
}  # fmt: skip
#: The default ``include`` patterns of each format.
INCLUDE = {kind: tuple(f"*{s}" for s in suffixes) for kind, suffixes in SUFFIXES.items()}
INCLUDE["text"] = ("*.py", "*.txt", "*.md")
#: Dtypes a ``.bin`` token file may be stated in.
TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64", "uint64")
LENGTHS_SUFFIX = ".lengths.npy"
#: Bytes of a plain JSON-lines file read per look for a line's end.
_CHUNK = 1 << 20


class CorpusError(ValueError):
    """A source file that cannot be read as its format says; the message names the file and the place."""


#: The byte tokenizer's: bytes 0..255, then the end-of-document id.
EOS = 256
VOCAB_SIZE = 257


@dataclass(frozen=True)
class Options:
    """How the files of a corpus are read (PrepareSpec's, checked there)."""

    field: str = "text"
    token_dtype: str | None = None  # of .bin files
    eos: int = EOS  # the end-of-document id (the tokenizer's, or the byte tokenizer's, or stated)
    vocab_size: int = VOCAB_SIZE  # token files' ids must be below it


def kind_of(name: str, fmt: str) -> str:
    """The kind of the file ``name`` under ``format`` (``auto``: by its ending; never a lengths file's own)."""
    if fmt != "auto":
        return fmt
    lower = name.lower()
    for kind, suffixes in SUFFIXES.items():
        if lower.endswith(suffixes):
            return kind
    return "text"


def is_lengths_file(name: str) -> bool:
    return name.endswith(LENGTHS_SUFFIX)


def is_val(rel: str, key: int, fraction: float) -> bool:
    """Whether document ``key`` of file ``rel`` is held out: a hash of both, so stable as a corpus grows."""
    digest = hashlib.blake2b(f"{rel}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


# -- units ------------------------------------------------------------------------------------------------------
def units(kind: str, path: Path, part_bytes: int, opts: Options) -> list[tuple[int, int, int]]:
    """(lo, hi, bytes) of each unit of the file: byte ranges (plain JSON lines), row groups (Parquet), token ranges
    (tokens) or the whole file (0, 0, size)."""
    size = path.stat().st_size
    if kind == "jsonl" and not _compressed(path):
        return [(lo, min(lo + part_bytes, size), min(part_bytes, size - lo)) for lo in range(0, size, part_bytes)] or [
            (0, 0, 0)
        ]
    if kind == "parquet":
        meta = _parquet(path).metadata
        return [(g, g + 1, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]
    if kind == "tokens":
        tokens = _token_array(path, opts)
        step = max(1, part_bytes // tokens.itemsize)
        return [(lo, min(lo + step, len(tokens)), (min(lo + step, len(tokens)) - lo) * tokens.itemsize)
                for lo in range(0, len(tokens), step)] or [(0, 0, 0)]  # fmt: skip
    return [(0, 0, size)]


# -- documents --------------------------------------------------------------------------------------------------
def documents(kind: str, path: Path, lo: int, hi: int, opts: Options) -> Iterator[tuple[int, bytes | np.ndarray]]:
    """(key, document) of the unit [lo, hi) of the file: text as UTF-8 bytes, token ids as an array that ends with
    the end-of-document id."""
    if kind == "text":
        yield 0, path.read_bytes()
    elif kind == "jsonl":
        yield from _json_lines(path, lo, hi, opts.field)
    elif kind == "parquet":
        yield from _parquet_rows(path, lo, opts.field)
    elif kind == "arrow":
        yield from _arrow_rows(path, opts.field)
    elif kind == "tokens":
        yield from _token_documents(path, lo, hi, opts)
    else:
        raise CorpusError(f"{path}: unknown format {kind!r}; one of {', '.join(KINDS)}")


def _compressed(path: Path) -> bool:
    return path.name.lower().endswith((".gz", ".zst"))


def _text_of(path: Path, where: str, value: object, field: str) -> bytes:
    if not isinstance(value, str):
        shown = "null" if value is None else type(value).__name__
        raise CorpusError(f"{path}: {where}: field {field!r} is {shown}, not a string")
    return value.encode("utf-8", errors="surrogatepass")


def _json_lines(path: Path, lo: int, hi: int, field: str) -> Iterator[tuple[int, bytes]]:
    if _compressed(path):
        number = 0
        try:
            for number, line in enumerate(_open_compressed(path), 1):  # noqa: B007 (the last names a cut file)
                if line.strip():
                    yield number, _json_text(path, f"line {number}", line, field)
        except CorpusError:
            raise
        except (EOFError, OSError, ValueError) as exc:  # gzip's EOFError / BadGzipFile, zstd's errors
            raise CorpusError(f"{path}: truncated or corrupt compressed stream after line {number} ({exc})") from None
        return
    with open(path, "rb") as f:
        pos = lo
        if lo > 0:
            f.seek(lo - 1)
            if f.read(1) != b"\n":  # the line begun before lo is the earlier range's
                f.readline()
            pos = f.tell()
        while pos < hi:
            line = f.readline()
            if not line:
                break
            if line.strip():
                try:
                    yield pos, _json_text(path, "", line, field)
                except CorpusError as exc:
                    raise CorpusError(str(exc).replace(": : ", f": line {_line_number(path, pos)}: ", 1)) from None
            pos += len(line)


def _json_text(path: Path, where: str, line: bytes, field: str) -> bytes:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise CorpusError(f"{path}: {where}: not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise CorpusError(f"{path}: {where}: a JSON {type(record).__name__}, not an object")
    if field not in record:
        keys = ", ".join(sorted(record)[:8]) or "none"
        raise CorpusError(f"{path}: {where}: no field {field!r} (its fields: {keys}); name the text's field")
    return _text_of(path, where, record[field], field)


def _line_number(path: Path, pos: int) -> int:
    """The 1-based number of the line that starts at byte ``pos`` (counted only for an error's message)."""
    count, done = 1, 0
    with open(path, "rb") as f:
        while done < pos:
            chunk = f.read(min(_CHUNK, pos - done))
            if not chunk:
                break
            count += chunk.count(b"\n")
            done += len(chunk)
    return count


def _open_compressed(path: Path) -> Iterator[bytes]:
    """The lines of a .gz or .zst file; EOFError when it ends inside a compressed stream (a file cut short)."""
    if path.name.lower().endswith(".gz"):
        with gzip.open(path, "rb") as f:
            yield from f
        return
    carry = b""
    for data in _zstd_chunks(path):
        lines = (carry + data).split(b"\n")
        carry = lines.pop()
        for line in lines:
            yield line + b"\n"
    if carry:
        yield carry


def _zstd_chunks(path: Path) -> Iterator[bytes]:
    """A .zst file's decompressed bytes, frame after frame. zstandard's stream reader ends quietly where a file was
    cut short; the decompressor objects here say whether the input ended at a frame's end."""
    import zstandard

    fresh = lambda: zstandard.ZstdDecompressor().decompressobj()  # noqa: E731
    frame, fed = fresh(), False
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            while chunk:
                try:
                    yield frame.decompress(chunk)
                except zstandard.ZstdError as exc:
                    raise ValueError(str(exc)) from None
                fed = True
                if frame.eof:
                    chunk, frame, fed = frame.unused_data, fresh(), False
                else:
                    chunk = b""
    if fed:
        raise EOFError("the file ends inside a zstd frame")


def _parquet(path: Path):  # noqa: ANN202
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's ArrowInvalid, OSError: not a Parquet file, or cut short
        raise CorpusError(f"{path}: not a readable Parquet file ({exc})") from None


def _column(path: Path, table, field: str, what: str):  # noqa: ANN001, ANN202
    import pyarrow as pa

    names = table.schema.names
    if field not in names:
        raise CorpusError(f"{path}: no column {field!r} (its columns: {', '.join(names[:8])}); name the text's column")
    column = table.column(field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise CorpusError(f"{path}: column {field!r} holds {column.type}, not strings ({what})")
    return column


def _parquet_rows(path: Path, group: int, field: str) -> Iterator[tuple[int, bytes]]:
    pf = _parquet(path)
    first = sum(pf.metadata.row_group(g).num_rows for g in range(group))
    try:
        table = pf.read_row_group(group, columns=[field] if field in pf.schema_arrow.names else None)
    except Exception as exc:
        raise CorpusError(f"{path}: row group {group} cannot be read ({exc})") from None
    yield from _rows(path, _column(path, table, field, f"row group {group}"), first, field)


def _rows(path: Path, column, first: int, field: str) -> Iterator[tuple[int, bytes]]:  # noqa: ANN001
    for i, value in enumerate(column.to_pylist()):
        yield first + i, _text_of(path, f"row {first + i}", value, field)


def _arrow_rows(path: Path, field: str) -> Iterator[tuple[int, bytes]]:
    """The rows of an Arrow IPC file or stream, a record batch at a time (memory-mapped: a large file is never held
    whole as Python strings)."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            batches = iter(pa.ipc.open_stream(source))
    except Exception as exc:
        raise CorpusError(f"{path}: not a readable Arrow IPC file or stream ({exc})") from None
    first = 0
    with source:
        while True:
            try:
                batch = next(batches, None)
            except Exception as exc:  # a stream cut short or damaged part-way
                raise CorpusError(f"{path}: a record batch after row {first} cannot be read ({exc})") from None
            if batch is None:
                return
            yield from _rows(path, _column(path, batch, field, "arrow"), first, field)
            first += batch.num_rows


def _token_array(path: Path, opts: Options) -> np.ndarray:
    if path.name.lower().endswith(".npy"):
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CorpusError(f"{path}: not a readable .npy array ({exc})") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise CorpusError(f"{path}: holds a {tokens.ndim}-D {tokens.dtype} array, not 1-D integer token ids")
        return tokens
    if opts.token_dtype is None:
        raise CorpusError(f"{path}: a raw .bin token file needs its dtype stated (token_dtype / --token-dtype)")
    size, itemsize = path.stat().st_size, np.dtype(opts.token_dtype).itemsize
    if size % itemsize:
        raise CorpusError(f"{path}: {size} bytes is not a whole number of {opts.token_dtype} ids; is the dtype wrong?")
    return np.memmap(path, dtype=opts.token_dtype, mode="r") if size else np.empty(0, opts.token_dtype)


def _lengths(path: Path, count: int) -> np.ndarray | None:
    """Document start offsets from ``NAME.lengths.npy`` beside a token file, or None when there is none."""
    side = path.with_name(path.name.rsplit(".", 1)[0] + LENGTHS_SUFFIX)
    if not side.exists():
        return None
    try:
        lengths = np.load(side, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CorpusError(f"{side}: not a readable .npy array ({exc})") from None
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (lengths < 0).any():
        raise CorpusError(f"{side}: must be a 1-D array of document lengths >= 0")
    if int(lengths.sum()) != count:
        raise CorpusError(f"{side}: its lengths add up to {int(lengths.sum())} tokens, {path} holds {count}")
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def _token_documents(path: Path, lo: int, hi: int, opts: Options) -> Iterator[tuple[int, np.ndarray]]:
    tokens = _token_array(path, opts)
    starts = _lengths(path, len(tokens))
    if starts is not None:
        first = int(np.searchsorted(starts[:-1], lo, side="left"))
        for d in range(first, len(starts) - 1):
            a, b = int(starts[d]), int(starts[d + 1])
            if a >= hi:
                break
            if b > a:
                yield a, _checked(path, tokens, a, b, opts, eos=True)
        return
    n = len(tokens)
    start = lo
    if lo > 0 and tokens[lo - 1] != opts.eos:  # the document begun before lo is the earlier range's
        start = _next_end(tokens, lo, opts.eos) + 1
    if start >= min(hi, n):
        return
    ends = np.flatnonzero(np.asarray(tokens[start:hi]) == opts.eos) + start  # once per unit, not per document
    for end in ends:
        yield start, _checked(path, tokens, start, int(end) + 1, opts, eos=False)
        start = int(end) + 1
    if start < min(hi, n):  # the last document begun in the range ends after it (or with the file, unterminated)
        end = _next_end(tokens, hi, opts.eos)
        yield start, _checked(path, tokens, start, min(end + 1, n), opts, eos=end >= n)


def _next_end(tokens: np.ndarray, at: int, eos: int) -> int:
    """The index of the first end-of-document id at or after ``at`` (``len(tokens)`` when there is none)."""
    step = 1 << 20
    for a in range(at, len(tokens), step):
        found = np.flatnonzero(np.asarray(tokens[a : a + step]) == eos)
        if len(found):
            return a + int(found[0])
    return len(tokens)


def _checked(path: Path, tokens: np.ndarray, a: int, b: int, opts: Options, *, eos: bool) -> np.ndarray:
    """Tokens [a, b) as int64 (then the end-of-document id when ``eos``); every id below the vocabulary."""
    doc = np.asarray(tokens[a:b]).astype(np.int64)
    bad = np.flatnonzero((doc < 0) | (doc >= opts.vocab_size))
    if len(bad):
        i = a + int(bad[0])
        raise CorpusError(f"{path}: token {i} is {int(doc[bad[0]])}, outside the vocabulary of {opts.vocab_size} "
                          "(a wrong dtype, or the wrong tokenizer / vocab_size?)")  # fmt: skip
    return np.append(doc, opts.eos) if eos else doc
