"""The recipe: a small GRU language model over bytes, its data a `datasets` dataset saved to disk (make_dataset.py).

Named in config.yaml as ``recipe: hf_text.train:recipe``. The trainer needs a map-style dataset (``len`` and
``ds[i]``, a pure function of i); a `datasets.Dataset` is one, so the wrapper below only turns its rows into the
(input, target) tensors the loss takes. ``load_from_disk`` memory-maps the Arrow files: every rank opens them, none
copies them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainer.recipes import Recipe, RecipeContext

VOCAB = 256  # bytes


class Windows(Dataset):
    """One split of the saved dataset: ``ds[i]`` is (bytes [seq_len] int64, next bytes [seq_len] int64)."""

    def __init__(self, rows) -> None:  # noqa: ANN001 (a datasets.Dataset)
        self.rows = rows.with_format("numpy", columns=["ids"])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.from_numpy(np.asarray(self.rows[int(i)]["ids"], dtype=np.int64))
        return ids[:-1], ids[1:]


class ByteGRU(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.gru = nn.GRU(width, width, num_layers=layers, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.gru(self.embed(ids))
        return self.head(hidden)


def next_byte_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, targets = batch
    return F.cross_entropy(model(ids).float().flatten(0, 1), targets.flatten())


def recipe(ctx: RecipeContext, dataset: str, width: int = 64, layers: int = 1) -> Recipe:
    import datasets  # the user's own dependency, imported where it is used

    path = Path(dataset).expanduser()
    if not (path / "dataset_dict.json").is_file():
        raise ValueError(f"dataset {path} is not a DatasetDict saved with save_to_disk; make it with "
                         "examples/hf_text/hf_text/make_dataset.py")  # fmt: skip
    saved = datasets.load_from_disk(str(path))
    seq_len = len(saved["train"][0]["ids"]) - 1
    return Recipe(
        model=ByteGRU(width, layers),
        train_data=Windows(saved["train"]),
        eval_data=Windows(saved["val"]),
        loss=next_byte_loss,
        unit="tokens",
        units_per_sample=seq_len,
    )
