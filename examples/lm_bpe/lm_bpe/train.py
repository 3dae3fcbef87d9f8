"""The recipe: TinyLM (model.py) on the token windows of the ``data:`` section, prepared with tokenizer.json.

Named in config.yaml as ``recipe: lm_bpe.train:recipe``; the trainer calls ``recipe(ctx, **recipe_args)`` on every
rank. The vocabulary comes from the prepared data's manifest (``train.vocab_size``: the tokenizer's 2048), so the
model always matches whatever tokenizer ``data.tokenizer`` names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lm_bpe.model import TinyLM
from trainer.recipes import Recipe, RecipeContext


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting window[:, 1:] from window[:, :-1] (a window holds seq_len + 1 tokens)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def train_flops_per_token(model: nn.Module, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward (= 3 x forward):

    - 6 x (weights of every matrix multiply): 2 FLOPs per multiply-add in the forward pass, 4 in the backward;
      the matrices are the Linear layers and the tied output head (embedding look-ups are not multiplies);
    - 12 x n_layers x d_model x seq_len for attention (q.k scores and the weighted sum of v, 2 x 2 x d x seq_len
      per layer forward, times 3), counting the full seq_len x seq_len square as the usual convention does
      (PaLM's appendix B; nanoGPT's estimate_mfu).
    """
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6.0 * matmul + 12.0 * n_layers * d_model * seq_len


def recipe(
    ctx: RecipeContext,
    seq_len: int = 128,
    d_model: int = 128,
    n_layers: int = 2,
    n_heads: int = 4,
    dropout: float = 0.0,
) -> Recipe:
    for name, value in (("seq_len", seq_len), ("d_model", d_model), ("n_layers", n_layers), ("n_heads", n_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if d_model % n_heads:
        raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")

    train, val = ctx.token_data(seq_len)  # collective: every rank calls it; rank 0 prepares the data once
    model = TinyLM(train.vocab_size, seq_len, d_model, n_layers, n_heads, dropout)
    return Recipe(
        model=model,
        train_data=train,  # int64 windows of seq_len + 1 tokens; the default collate stacks them
        eval_data=val,
        loss=next_token_loss,
        unit="tokens",
        units_per_sample=seq_len,
        flops_per_sample=train_flops_per_token(model, n_layers, d_model, seq_len) * seq_len,
        # n_heads changes no parameter shape but does change the model: a resume across it is refused
        architecture={"vocab_size": train.vocab_size, "seq_len": seq_len, "d_model": d_model, "n_heads": n_heads},
    )
