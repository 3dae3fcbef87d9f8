"""A byte-level language model trained on a Hugging Face `datasets` dataset saved to disk, as a trainer recipe."""
