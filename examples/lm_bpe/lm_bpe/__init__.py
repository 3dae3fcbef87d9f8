"""A small causal transformer language model on BPE-tokenized text, as a trainer recipe (see ../README.md)."""
