"""Object storage anywhere a path is taken: raw text to prepare (data.source), the tokenizer (data.tokenizer) and a
recipe's own files (``ctx.open``), each by URL, with errors naming the URL."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from runconfig import load_config
from tests.conftest import ROOT, run_cli, summary
from tests.s3.conftest import BUCKET
from trainer.errors import UserError
from trainer.recipes.api import RecipeContext

TOKENIZER = ROOT / "examples" / "lm_bpe" / "tokenizer.json"


@pytest.fixture(scope="module")
def remote_inputs(s3) -> tuple[str, str]:
    fs = s3.fs()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in ("json", "email", "http"):
        for path in sorted((stdlib / package).glob("*.py")):
            fs.put_file(str(path), f"{BUCKET}/src/{package}/{path.name}")
    fs.put_file(str(stdlib / "json" / "__init__.py"), f"{BUCKET}/src/README.txt")  # not in data.include
    fs.put_file(str(TOKENIZER), f"{BUCKET}/tok/tokenizer.json")
    return f"s3://{BUCKET}/src", f"s3://{BUCKET}/tok/tokenizer.json"


def test_source_and_tokenizer_by_url(tmp_path, remote_inputs, isolated_data_cache):
    source, tokenizer = remote_inputs
    run_dir = tmp_path / "run"
    args = ["-m", "hpc.submit", "tiny", "--local", "--run-dir", str(run_dir)]
    for s in (f"data.source={source}", f"data.tokenizer={tokenizer}", "model.vocab_size=2048", "job.nodes=1",
              "model.d_model=32", "model.n_layers=1", "model.seq_len=32", "train.steps=3", "train.eval_every=0",
              "data.val_fraction=0.2", "data.shard_tokens=20000", "checkpoint.every_steps=0"):  # fmt: skip
        args += ["--set", s]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary(run_dir)["params_sha256"]
    manifests = list(isolated_data_cache.glob("*/manifest.json"))
    mine = [json.loads(m.read_text()) for m in manifests if "sources" in json.loads(m.read_text())["source"]]
    assert mine and mine[0]["tokenizer_sha256"] and mine[0]["vocab_size"] == 2048
    mirrored = Path(mine[0]["source"])
    assert (mirrored / "json" / "decoder.py").is_file() and not (mirrored / "README.txt").exists()
    assert mine[0]["source_files"] == len(list(mirrored.rglob("*.py")))


def test_a_missing_source_or_tokenizer_url_is_named(tmp_path, s3):
    for key, url in (("data.source", f"s3://{BUCKET}/no-text"), ("data.tokenizer", f"s3://{BUCKET}/no/tok.json")):
        args = ["-m", "hpc.submit", "tiny", "--local", "--run-dir", str(tmp_path / key), "--set", f"{key}={url}",
                "--set", "job.nodes=1"]  # fmt: skip
        proc = run_cli(args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert url in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_recipe_opens_its_own_files_by_url(remote_inputs, tmp_path):
    ctx = RecipeContext(rank=0, world_size=1, local_rank=0, seed=1, device=torch.device("cpu"), micro_batch_size=1,
                        config=load_config("tiny"), run_dir=tmp_path, cache_dir=tmp_path)  # fmt: skip
    with ctx.open(remote_inputs[1]) as f:
        assert f.read() == TOKENIZER.read_bytes()
    with ctx.open(str(TOKENIZER)) as f:  # a plain path works the same
        assert f.read(10) == TOKENIZER.read_bytes()[:10]
    with pytest.raises(UserError, match=f"rank 0: recipe file s3://{BUCKET}/nope.bin: no such object at http://"):
        ctx.open(f"s3://{BUCKET}/nope.bin")
