"""Packing by document (model.doc_mask): attention and positions stay inside each document of a packed window, so a
document's logits are those it would have alone at the start of a window, whatever precedes it."""

from __future__ import annotations

import pytest
import torch

from runconfig import ConfigError, load_config
from runconfig.schema import ModelConfig
from trainer.data.documents import document_ids, document_mask, document_positions
from trainer.models.gpt import GPT

EOS = 9
CFG = ModelConfig(vocab_size=10, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def test_ids_positions_and_mask():
    tokens = torch.tensor([[1, 2, EOS, 3, 4, 5, EOS, 6]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert document_positions(tokens, EOS).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    mask = document_mask(document_ids(tokens, EOS))
    assert mask.shape == (1, 1, 8, 8)
    mask = mask[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[2].tolist() == [True, True, True, False, False, False, False, False]


@pytest.mark.parametrize("masked", [True, False])
def test_a_document_does_not_see_the_one_before_it(masked):
    torch.manual_seed(0)
    model = GPT(CFG, eos=EOS if masked else None).eval()
    second = torch.tensor([[3, 1, 4, 1, 5, 2]])
    first = torch.tensor([[1, 2, 3, EOS], [7, 6, 5, EOS]])  # a batch of two windows
    with torch.no_grad():
        alone = model(second)[0]
        packed = model(torch.cat([first, second.expand(2, -1)], dim=1))[:, 4:]
    a, b = packed
    same = torch.allclose(a, alone, atol=1e-5) and torch.allclose(b, alone, atol=1e-5)
    assert same == masked  # without the mask the second document's logits depend on the first one


def test_doc_mask_is_refused_with_pipeline_parallelism():
    with pytest.raises(ConfigError, match="model.doc_mask.*not available with pipeline parallelism"):
        load_config("tiny", ["model.doc_mask=true", "parallel.pp=2"])
