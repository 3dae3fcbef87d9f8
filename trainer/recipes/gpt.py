"""The built-in recipe (``recipe: gpt``): the byte-level (or tokenizer-prepared) GPT of trainer/models/gpt.py on
the prepared HDF5 token data of the ``data:`` section, shaped by the ``model:`` section."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from trainer.models.gpt import GPT, context_parallel, flops_per_token, loss_fn, next_tokens, pipeline, tp_plan
from trainer.recipes.api import Recipe, RecipeContext


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting window[:, 1:] from window[:, :-1]."""
    inputs, targets = next_tokens(batch)
    return loss_fn(model(inputs), targets)


def recipe(ctx: RecipeContext) -> Recipe:
    cfg = ctx.config.model
    train, val = ctx.token_data(cfg.seq_len, vocab_size=cfg.vocab_size)
    model = GPT(cfg, eos=train.eos if cfg.doc_mask else None)
    return Recipe(
        model=model,
        train_data=train,
        eval_data=val,
        loss=next_token_loss,
        unit="tokens",
        units_per_sample=cfg.seq_len,
        flops_per_sample=flops_per_token(model) * cfg.seq_len,
        tp_plan=tp_plan,
        output_layer="head",
        pipeline=pipeline(),
        context_parallel=context_parallel(),
        init_weights=model.init_weights,
        architecture={k: v for k, v in dataclasses.asdict(cfg).items() if k != "dropout"},
    )
