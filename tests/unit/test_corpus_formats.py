"""Corpora as they come: JSON lines (plain, .gz, .zst), Parquet, Arrow (a `datasets` save_to_disk layout) and token
arrays, prepared into the same shards however the work is cut, and a bad file of each kind refused by name."""

import gzip
import json
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from trainer.data.__main__ import main as prepare_cli
from trainer.data.formats import CorpusError
from trainer.data.prepare import PrepareSpec, prepare

DOCS = [f"document {i}: " + "word " * (i % 23) + "é" * (i % 3) for i in range(1200)]
EOS = 256


def spec(source, **kw) -> PrepareSpec:
    base = dict(source=str(source), include=("*",), max_source_bytes=0, val_fraction=0.2, shard_tokens=4096)
    return PrepareSpec(**{**base, **kw})


def jsonl(docs, field="text") -> str:
    return "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs))


def corpus(root: Path) -> Path:
    """The same documents in each record format, a quarter each."""
    src = root / "src"
    (src / "arrow").mkdir(parents=True)
    q = len(DOCS) // 5
    (src / "a.jsonl").write_text(jsonl(DOCS[:q]))
    with gzip.open(src / "b.jsonl.gz", "wt") as f:
        f.write(jsonl(DOCS[q : 2 * q]))
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(DOCS[2 * q : 3 * q]).encode()))
    pq.write_table(pa.table({"text": DOCS[3 * q : 4 * q], "n": list(range(q))}), src / "d.parquet", row_group_size=50)
    # what datasets' save_to_disk writes: Arrow streams, data-NNNNN-of-NNNNN.arrow, beside two JSON files
    table = pa.table({"text": DOCS[4 * q :]})
    sink = pa.OSFile(str(src / "arrow" / "data-00000-of-00001.arrow"), "wb")
    with sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=64)
    (src / "arrow" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (src / "arrow" / "dataset_info.json").write_text("{}")
    return src


def streams(out: Path) -> dict[str, np.ndarray]:
    manifest = json.loads((out / "manifest.json").read_text())
    got = {}
    for split, shards in manifest["splits"].items():
        parts = []
        for shard in shards:
            with h5py.File(out / shard["file"]) as f:
                parts.append(f["tokens"][:])
        got[split] = np.concatenate(parts)
    return got


def documents_of(tokens: np.ndarray) -> list[str]:
    cuts = np.flatnonzero(tokens == EOS)
    return [bytes(tokens[a + 1 if i else 0 : b].astype(np.uint8)).decode() for i, (a, b) in
            enumerate(zip(np.r_[-1, cuts[:-1]], cuts, strict=True))]  # fmt: skip


def test_every_record_format_gives_its_documents_the_same_whatever_the_cut(tmp_path):
    src = corpus(tmp_path)
    patterns = ("*.jsonl", "*.jsonl.gz", "*.jsonl.zst", "*.parquet", "*.arrow")
    whole = prepare(spec(src, include=patterns), tmp_path / "whole", workers=1)
    cut = prepare(spec(src, include=patterns), tmp_path / "cut", workers=2, part_bytes=2048)
    assert whole["source_formats"] == {"arrow": 1, "jsonl": 3, "parquet": 1} and whole["source_field"] == "text"
    assert [s["sha256"] for s in whole["splits"]["train"]] == [s["sha256"] for s in cut["splits"]["train"]]
    assert [s["sha256"] for s in whole["splits"]["val"]] == [s["sha256"] for s in cut["splits"]["val"]]
    got = streams(tmp_path / "cut")
    train, val = documents_of(got["train"]), documents_of(got["val"])
    assert sorted(train + val) == sorted(DOCS)  # every document once, whole, in one split or the other
    assert 0.1 < len(val) / len(DOCS) < 0.3  # held out by document, not by file
    assert whole["documents"] == {"train": len(train), "val": len(val)}


def test_a_named_field_and_a_single_file_source(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(jsonl(DOCS[:300], field="content"))
    manifest = prepare(spec(path, field="content", format="jsonl"), tmp_path / "out")
    assert manifest["source_files"] == 1 and sum(manifest["documents"].values()) == 300


def test_token_files_split_at_eos_or_by_lengths(tmp_path):
    src = tmp_path / "tok"
    src.mkdir()
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=int(n), dtype=np.int64) for n in rng.integers(1, 60, size=400)]
    sep = np.concatenate([np.append(d, 1000) for d in docs[:200]])
    np.save(src / "a.npy", sep.astype(np.uint16))  # separated by EOS 1000
    np.concatenate(docs[200:]).astype(np.int32).tofile(src / "b.bin")  # lengths beside it
    np.save(src / "b.lengths.npy", np.array([len(d) for d in docs[200:]]))
    kw = dict(format="tokens", include=("*.npy", "*.bin"), token_dtype="int32", vocab_size=1001, eos=1000)
    whole = prepare(spec(src, **kw), tmp_path / "whole")
    cut = prepare(spec(src, **kw), tmp_path / "cut", workers=2, part_bytes=256)
    assert [s["sha256"] for s in whole["splits"]["train"]] == [s["sha256"] for s in cut["splits"]["train"]]
    assert whole["tokenizer"] == "pretokenized" and whole["vocab_size"] == 1001 and whole["eos"] == 1000
    assert sum(whole["documents"].values()) == 400  # the lengths file is read with its tokens, not as a source
    assert sum(whole["tokens"].values()) == sum(len(d) + 1 for d in docs)


def test_token_files_need_a_vocabulary(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(CorpusError, match=r"a\.npy: token files need their vocabulary"):
        prepare(spec(tmp_path, format="tokens"), tmp_path / "out")


def corrupt(tmp_path: Path, kind: str) -> tuple[Path, str, dict]:
    """A bad file of ``kind``, what the error must say, and the spec's other settings."""
    path = tmp_path / {"json": "bad.jsonl", "field": "bad.jsonl", "gz": "bad.jsonl.gz", "zst": "bad.jsonl.zst",
                       "parquet": "bad.parquet", "column": "bad.parquet", "arrow": "bad.arrow", "arrowcut": "bad.arrow",
                       "bin": "bad.bin",
                       "vocab": "bad.npy"}[kind]  # fmt: skip
    body = jsonl(DOCS[:500]).encode()
    if kind == "json":
        lines = body.splitlines(keepends=True)
        lines[417] = b'{"text": "cut\n'
        path.write_bytes(b"".join(lines))
        return path, r"bad\.jsonl: line 418: not JSON", {}
    if kind == "field":
        path.write_text(jsonl(DOCS[:20]) + json.dumps({"body": "x"}) + "\n")
        return path, r"bad\.jsonl: line 21: no field 'text' \(its fields: body\)", {}
    if kind == "gz":
        path.write_bytes(gzip.compress(body)[:-100])
        return path, r"bad\.jsonl\.gz: truncated or corrupt compressed stream", {}
    if kind == "zst":
        path.write_bytes(zstandard.ZstdCompressor().compress(body)[:-100])
        return path, r"bad\.jsonl\.zst: truncated or corrupt compressed stream", {}
    if kind == "parquet":
        pq.write_table(pa.table({"text": DOCS[:100]}), path)
        path.write_bytes(path.read_bytes()[:-40])
        return path, r"bad\.parquet: not a readable Parquet file", {}
    if kind == "column":
        pq.write_table(pa.table({"body": DOCS[:10]}), path)
        return path, r"bad\.parquet: no column 'text' \(its columns: body\)", {}
    if kind == "arrow":
        path.write_bytes(b"not arrow at all" * 10)
        return path, r"bad\.arrow: not a readable Arrow IPC file or stream", {}
    if kind == "arrowcut":  # a stream cut part-way: the batches before the cut are read, then the file is named
        table = pa.table({"text": DOCS[:500]})
        sink = pa.OSFile(str(path), "wb")
        with sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=100)
        path.write_bytes(path.read_bytes()[:-3000])
        return path, r"bad\.arrow: a record batch after row \d+ cannot be read", {}
    if kind == "bin":
        path.write_bytes(np.arange(11, dtype=np.uint16).tobytes()[:-1])
        return path, r"bad\.bin: 21 bytes is not a whole number of uint16 ids", dict(token_dtype="uint16")
    np.save(path, np.array([1, 2, 3, 70000, 4], dtype=np.uint32))
    return path, r"bad\.npy: token 3 is 70000, outside the vocabulary of 1001", {}


BAD = ["json", "field", "gz", "zst", "parquet", "column", "arrow", "arrowcut", "bin", "vocab"]


@pytest.mark.parametrize("kind", BAD)
def test_a_bad_file_is_refused_by_name_and_place(tmp_path, kind):
    path, message, extra = corrupt(tmp_path, kind)
    tokens = kind in ("bin", "vocab")
    kw = dict(vocab_size=1001, eos=1000, **extra) if tokens else {}
    with pytest.raises(CorpusError, match=message):
        prepare(spec(path, **kw), tmp_path / "out", part_bytes=1024)
    assert not (tmp_path / "out").exists()  # nothing half-made where the dataset would be


def test_the_command_names_the_file_and_line(tmp_path, capsys):
    path, _, _ = corrupt(tmp_path, "field")
    assert prepare_cli(["prepare", "--source", str(path), "--out", str(tmp_path / "out"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot prepare {path} into {tmp_path / 'out'}: {path}: line 21: no field 'text'" in err
