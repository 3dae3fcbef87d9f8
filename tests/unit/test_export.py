"""trainer.export's pieces that need no run: ties, the GPT-2 mapping, and what it refuses (the exports of real runs
of every layout, one from a bucket: tests/mp/test_parallel.py, tests/s3/test_checkpoint_storage.py)."""

import json

import pytest
import torch

from trainer.export import ExportError, export, gpt2_equivalent, main, untie

ARCH = {"vocab_size": 257, "seq_len": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "mlp_ratio": 4, "doc_mask": False}


def test_a_tied_copy_is_written_once_and_named():
    emb = torch.randn(5, 3)
    tensors = {"tok.weight": emb.clone(), "head.weight": emb.clone(), "pos.weight": torch.randn(4, 3),
               "other": torch.randn(5, 3)}  # fmt: skip
    kept, ties = untie(tensors, ["tok.weight", "pos.weight", "other"])
    assert ties == {"head.weight": "tok.weight"} and set(kept) == {"tok.weight", "pos.weight", "other"}


def test_the_gpt_says_how_it_maps_onto_gpt2():
    same = gpt2_equivalent(ARCH)
    assert same["matches"] == "GPT2LMHeadModel" and same["config"]["n_inner"] == 128
    assert gpt2_equivalent({**ARCH, "doc_mask": True})["matches"] is None


def test_what_is_not_a_run_or_has_no_checkpoint_is_refused(tmp_path, capsys):
    with pytest.raises(ExportError, match="is not a run directory"):
        export(tmp_path, tmp_path / "out")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("recipe: gpt\n")
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 2
    assert f"error: {tmp_path / 'run'} has no committed checkpoint to export." in capsys.readouterr().err
    assert main([str(tmp_path / "run"), "--step", "7", "--out", str(tmp_path / "out")]) == 2
    assert "has no checkpoint of step 7" in capsys.readouterr().err
    assert main([str(tmp_path / "mistyped")]) == 2  # without --out: named, no traceback, nothing written
    assert f"error: {tmp_path / 'mistyped'} is not a run directory" in capsys.readouterr().err
    assert main([str(tmp_path / "run")]) == 2 and not list((tmp_path / "run").glob(".export-*"))
    assert "has no committed checkpoint to export" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ExportError, match="is not empty"):
        export(tmp_path / "run", tmp_path / "full")


def test_the_gpt2_mapping_gives_hugging_face_the_same_logits(tmp_path):
    """An export folder of the built-in GPT, loaded into transformers' GPT2LMHeadModel through gpt2_weights and the
    config.json's hugging_face config: the same logits as the plain-torch loader's."""
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    from runconfig.schema import ModelConfig
    from trainer.export import CONFIG, WEIGHTS, gpt2_weights, load_gpt
    from trainer.models.gpt import GPT

    arch = {k: v for k, v in ARCH.items() if k != "doc_mask"}
    torch.manual_seed(0)
    model = GPT(ModelConfig(**arch))
    weights = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # tied to tok.weight
    save_file(weights, str(tmp_path / WEIGHTS))
    config = {
        "recipe": "gpt",
        "gpt": arch,
        "tied": {"head.weight": "tok.weight"},
        "hugging_face": gpt2_equivalent(ARCH),
    }
    (tmp_path / CONFIG).write_text(json.dumps(config))
    hf = GPT2LMHeadModel(GPT2Config(**config["hugging_face"]["config"])).eval()
    missing, unexpected = hf.load_state_dict(gpt2_weights(tmp_path), strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    ids = torch.randint(0, ARCH["vocab_size"], (2, ARCH["seq_len"]))
    with torch.no_grad():
        ours, theirs = load_gpt(tmp_path)(ids), hf(ids).logits
    assert ours.shape == theirs.shape and torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    doc_masked = {**config, "hugging_face": gpt2_equivalent({**ARCH, "doc_mask": True})}
    (tmp_path / CONFIG).write_text(json.dumps(doc_masked))
    with pytest.raises(ExportError, match="model.doc_mask keeps attention inside each document"):
        gpt2_weights(tmp_path)
