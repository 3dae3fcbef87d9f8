"""The built-in GPT's shape (``recipe: gpt``)."""

from __future__ import annotations

from dataclasses import dataclass

from runconfig.schema.fields import Problems, Range, Section, doc


@dataclass(frozen=True, kw_only=True)
class ModelConfig(Section):
    """The built-in GPT's shape: the arguments of ``recipe: gpt``. Another recipe takes its own from recipe_args."""

    vocab_size: int = doc(
        "Vocabulary size; must cover the dataset's tokenizer (byte-level: 257).", 257, bounds=Range(ge=1)
    )
    seq_len: int = doc("Context length in tokens of each training sequence.", 128, bounds=Range(ge=1))
    d_model: int = doc("Width of the residual stream.", 128, bounds=Range(ge=1))
    n_layers: int = doc("Number of transformer blocks.", 2, bounds=Range(ge=1))
    n_heads: int = doc("Attention heads; must divide d_model.", 4, bounds=Range(ge=1))
    mlp_ratio: int = doc("Hidden width of the MLP as a multiple of d_model.", 4, bounds=Range(ge=1))
    dropout: float = doc("Dropout probability (0 disables dropout).", 0.0, bounds=Range(ge=0, lt=1))
    doc_mask: bool = doc(
        "Keep attention and positions inside each document of a packed window: a token attends only to earlier "
        "tokens of its own document (the EOS that ends the previous one starts it), and positions restart at 0 "
        "with each document. Off: windows cut across documents are attended whole, as in GPT-2 and nanoGPT.",
        False,
    )

    def relations(self) -> Problems:
        if self.n_heads >= 1 and self.d_model % self.n_heads:
            return [("n_heads", f"{self.n_heads} does not divide d_model={self.d_model}")]
        return []
