"""Preparing data with a `tokenizers` tokenizer.json (PrepareSpec.tokenizer, --tokenizer, data.tokenizer)."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from runconfig.schema import DataConfig
from storage.digest import sha256_file
from tests.conftest import run_cli
from trainer.data.dataset import read_manifest
from trainer.data.prepare import PrepareSpec, TokenizerError, load_tokenizer, prepare
from trainer.errors import UserError

tokenizers = pytest.importorskip("tokenizers")

N_FILES = 30


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~30 of the stdlib's modules (UTF-8 text), copied so the test owns its source folder."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    src = tmp_path_factory.mktemp("corpus")
    taken = 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        if not 2_000 < len(data) < 40_000:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        (src / path.name).write_bytes(data)
        taken += 1
        if taken == N_FILES:
            break
    assert taken == N_FILES
    return src


def train_bpe(files: list[Path], out: Path, vocab_size: int = 512, special: str = "<|eos|>") -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    tok.save(str(out))
    return out


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory) -> Path:
    return train_bpe(sorted(corpus.glob("*.py")), tmp_path_factory.mktemp("tok") / "tokenizer.json")


def spec(src, **kw) -> PrepareSpec:
    base = {"source": str(src), "include": ("*.py",), "max_source_bytes": 0, "val_fraction": 0.2, "shard_tokens": 4096}
    return PrepareSpec(**{**base, **kw})


def split_tokens(folder: Path, manifest: dict, split: str) -> np.ndarray:
    parts = []
    for shard in manifest["splits"][split]:
        with h5py.File(folder / shard["file"]) as f:
            parts.append(f["tokens"][:])
    return np.concatenate(parts)


def test_prepare_with_tokenizer_round_trips(corpus, bpe, tmp_path):
    out = tmp_path / "data"
    manifest = prepare(spec(corpus, tokenizer=str(bpe)), out)
    assert manifest == read_manifest(out)
    tok = tokenizers.Tokenizer.from_file(str(bpe))
    eos = tok.token_to_id("<|eos|>")
    assert manifest["tokenizer"] == "tokenizer.json" and manifest["tokenizer_sha256"] == sha256_file(bpe)
    assert sha256_file(out / "tokenizer.json") == sha256_file(bpe)  # a copy kept next to the manifest
    assert manifest["vocab_size"] == tok.get_vocab_size() == 512
    assert manifest["eos_id"] == manifest["eos"] == eos
    assert manifest["dtype"] == "uint16" and manifest["source_files"] == N_FILES
    files = sorted(corpus.glob("*.py"))
    by_text = {p.read_text(encoding="utf-8"): p.name for p in files}
    seen = []
    for split in ("train", "val"):
        tokens = split_tokens(out, manifest, split)
        assert tokens.dtype == np.uint16 and int(tokens.max()) < 512
        assert len(tokens) == manifest["tokens"][split] and tokens[-1] == eos
        docs = np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]
        texts = [tok.decode(doc[:-1].tolist(), skip_special_tokens=False) for doc in docs]
        assert all(t in by_text for t in texts), "a decoded document differs from its source file"
        seen += [by_text[t] for t in texts]
    assert sorted(seen) == [p.name for p in files]  # every file once, in one of the splits
    total_bytes = sum(len(p.read_bytes()) for p in files)
    assert manifest["tokens"]["train"] + manifest["tokens"]["val"] < total_bytes / 2  # BPE compresses the text


def test_key_changes_with_the_tokenizer(corpus, bpe, tmp_path):
    plain = spec(corpus)
    with_bpe = spec(corpus, tokenizer=str(bpe))
    assert plain.key() != with_bpe.key()
    assert with_bpe.key() == spec(corpus, tokenizer=str(bpe)).key()
    moved = tmp_path / "elsewhere.json"
    shutil.copyfile(bpe, moved)
    assert spec(corpus, tokenizer=str(moved)).key() == with_bpe.key()  # the content counts, not the path
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(json.loads(bpe.read_text()), indent=1))  # same tokenizer, other bytes
    assert spec(corpus, tokenizer=str(changed)).key() != with_bpe.key()
    other = train_bpe(sorted(corpus.glob("*.py"))[:10], tmp_path / "other.json", vocab_size=300)
    assert spec(corpus, tokenizer=str(other)).key() != with_bpe.key()


def test_large_vocabulary_is_stored_as_uint32(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "words.json"
    tok.save(str(path))
    manifest = prepare(spec(corpus, tokenizer=str(path)), tmp_path / "data")
    assert manifest["dtype"] == "uint32" and manifest["vocab_size"] == 70_002 and manifest["eos_id"] == 0
    tokens = split_tokens(tmp_path / "data", manifest, "train")
    assert tokens.dtype == np.uint32 and tokens[-1] == 0


def test_missing_tokenizer_is_a_clear_error(corpus, tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    s = spec(corpus, tokenizer=str(missing))
    with pytest.raises(TokenizerError, match=f"tokenizer file {missing} does not exist"):
        s.key()
    with pytest.raises(TokenizerError, match="does not exist"):
        prepare(s, tmp_path / "data")
    assert not (tmp_path / "data").exists() and not list(tmp_path.glob(".data.tmp-*"))


@pytest.mark.parametrize(
    "content,needle",
    [
        ("{not json", "is not a valid tokenizer"),
        ('{"version": "1.0", "model": 3}', "is not a valid tokenizer"),
        (None, "no end-of-document token"),
    ],
)
def test_malformed_tokenizer_is_a_clear_error(corpus, bpe, tmp_path, content, needle):
    path = tmp_path / "bad.json"
    if content is None:  # a valid tokenizer whose special token is not an end-of-document one
        train_bpe(sorted(corpus.glob("*.py"))[:5], path, vocab_size=300, special="<|pad|>")
    else:
        path.write_text(content)
    with pytest.raises(TokenizerError, match=needle) as info:
        load_tokenizer(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(TokenizerError, match=needle):
        prepare(spec(corpus, tokenizer=str(path)), tmp_path / "data")
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("bad", ["missing", "malformed"])
def test_cli_tokenizer_errors_exit_2(corpus, tmp_path, bad):
    path = tmp_path / "tokenizer.json"
    if bad == "malformed":
        path.write_text("{not json")
    out = tmp_path / "out"
    args = ["-m", "trainer.data", "prepare", "--source", str(corpus), "--out", str(out), "--tokenizer", str(path)]
    proc = run_cli(args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and str(path) in proc.stderr and "--tokenizer" in proc.stderr
    assert not out.exists()


def test_cli_prepares_with_tokenizer(corpus, bpe, tmp_path):
    out = tmp_path / "out"
    args = ["-m", "trainer.data", "prepare", "--source", str(corpus), "--out", str(out), "--tokenizer", str(bpe)]
    proc = run_cli(args, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "vocabulary 512" in proc.stdout
    assert read_manifest(out)["tokenizer_sha256"] == sha256_file(bpe)


class _OneRank:
    """MPI's COMM_SELF, as far as open_splits uses it (MPI must not start in the test process)."""

    def allgather(self, value):
        return [value]

    def Ibarrier(self):  # noqa: N802 (mpi4py's name)
        return SimpleNamespace(Test=lambda: True)


def _env(cache: Path):
    return SimpleNamespace(rank=0, world_size=1, data_cache=cache, inject=())


def test_data_tokenizer_in_the_trainer(corpus, bpe, tmp_path):
    from trainer.data.resolve import dataset_folder, open_splits

    cfg = DataConfig(source=str(corpus), include=["*.py"], val_fraction=0.2, shard_tokens=4096, tokenizer=str(bpe))
    plain = DataConfig(source=str(corpus), include=["*.py"], val_fraction=0.2, shard_tokens=4096)
    assert dataset_folder(cfg, tmp_path) != dataset_folder(plain, tmp_path)
    # vocab_size=None: no vocabulary check (a model sized from the data); the windows carry the manifest's size
    train, val = open_splits(cfg, 32, None, _env(tmp_path), _OneRank())
    assert train.vocab_size == val.vocab_size == 512 and train.sample(0).shape == (33,)
    assert json.loads((dataset_folder(cfg, tmp_path) / "manifest.json").read_text())["vocab_size"] == 512
    with pytest.raises(UserError, match="smaller than the dataset's vocabulary"):
        open_splits(cfg, 32, 257, _env(tmp_path), _OneRank())
    # data.path with a data.tokenizer it was not prepared with
    other = DataConfig(path=str(dataset_folder(plain, tmp_path)), tokenizer=str(bpe))
    open_splits(plain, 32, 257, _env(tmp_path), _OneRank())
    with pytest.raises(UserError, match="is not the tokenizer the dataset"):
        open_splits(other, 32, None, _env(tmp_path), _OneRank())


@pytest.mark.parametrize("bad", ["missing", "no_eos"])
def test_data_tokenizer_errors_are_user_errors(corpus, tmp_path, bad):
    from trainer.data.resolve import open_splits

    path = tmp_path / "tokenizer.json"
    if bad == "no_eos":  # readable (so the cache key is computed) but refused by the prepare step
        train_bpe(sorted(corpus.glob("*.py"))[:5], path, vocab_size=300, special="<|pad|>")
    cfg = DataConfig(source=str(corpus), include=["*.py"], val_fraction=0.2, shard_tokens=4096, tokenizer=str(path))
    with pytest.raises(UserError, match=f"data.tokenizer: tokenizer file {path}") as info:
        open_splits(cfg, 32, None, _env(tmp_path / "cache"), _OneRank())
    assert info.value.collective
