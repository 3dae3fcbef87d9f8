"""Document boundaries inside packed token windows (documents back to back, each ended by the EOS token): which
document each token belongs to, its position inside it, and the attention mask that keeps each token to earlier
tokens of its own document. A token window from ``ctx.token_data`` carries the dataset's ``eos`` id."""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """(B, T) int64: the index of the document of each token within its window; an EOS belongs to the document it
    ends, and the token after it starts the next."""
    ends = tokens == eos
    return ends.long().cumsum(1) - ends.long()


def document_positions(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """(B, T) int64: each token's position inside its document (0 at the window's start and after every EOS)."""
    b, t = tokens.shape
    index = torch.arange(t, device=tokens.device).expand(b, t)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eos
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(1).values


def document_mask(doc: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool for scaled_dot_product_attention: query i may attend to key j when j <= i and both are in
    the same document (``doc`` from ``document_ids``)."""
    t = doc.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]
