"""A user's GPT recipe, written the way a user of the trainer would write one: bench/overhead.py's
``trainer-recipe`` variant, the same model and data as ``plain`` (bench/plain_ddp.py) entering through the
user-recipe door (``recipe: user_gpt:recipe`` + ``recipe_args``) instead of the built-in ``recipe: gpt``.

The benchmark copies this file next to the config it writes, so the submit-time code snapshot finds it there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runconfig.schema import ModelConfig
from trainer.models.gpt import GPT
from trainer.recipes import Recipe, RecipeContext


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting window[:, 1:] from window[:, :-1] (batch: int64 [B, seq_len + 1])."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def recipe(
    ctx: RecipeContext,
    *,
    seq_len: int = 128,
    d_model: int = 128,
    n_layers: int = 3,
    n_heads: int = 4,
    vocab_size: int = 257,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
    doc_mask: bool = False,
) -> Recipe:
    shape = ModelConfig(
        vocab_size=vocab_size,
        seq_len=seq_len,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        mlp_ratio=mlp_ratio,
        dropout=dropout,
        doc_mask=doc_mask,
    )
    problems = shape.check()
    if problems:
        raise ValueError("; ".join(f"{key}: {why}" for key, why in problems))
    train, val = ctx.token_data(seq_len, vocab_size=vocab_size)
    return Recipe(
        model=GPT(shape, eos=train.eos if doc_mask else None),
        train_data=train,
        eval_data=val,
        loss=next_token_loss,
        unit="tokens",
        units_per_sample=seq_len,
        architecture={"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "mlp_ratio": mlp_ratio},
    )
