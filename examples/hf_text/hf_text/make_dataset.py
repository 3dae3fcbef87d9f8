"""Make the example's dataset the way a user with a `datasets` corpus would: a DatasetDict of documents (here the
standard library's modules, nothing downloaded), cut into windows of SEQ_LEN + 1 bytes with ``Dataset.map``, saved
with ``save_to_disk``. The recipe (train.py) opens it with ``load_from_disk``: memory-mapped Arrow, shared by every
rank of a node.

    python examples/hf_text/hf_text/make_dataset.py OUT_DIR [--max-bytes N] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import datasets
import numpy as np

#: Every HOLD_OUT-th module is held out for evaluation.
HOLD_OUT = 10


def documents(max_bytes: int) -> dict[str, list]:
    root = Path(sysconfig.get_paths()["stdlib"])
    names, texts, total = [], [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if total + len(text) > max_bytes and texts:
            break
        names.append(path.name)
        texts.append(text)
        total += len(text)
    return {"name": names, "text": texts}


def windows(batch: dict[str, list], seq_len: int) -> dict[str, list]:
    """A batched ``map``: each document's UTF-8 bytes, cut into windows of seq_len + 1 (the last one dropped)."""
    out = []
    for text in batch["text"]:
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        for start in range(0, len(data) - seq_len, seq_len):
            out.append(data[start : start + seq_len + 1].tolist())
    return {"ids": out}


def make(out: Path, max_bytes: int = 400_000, seq_len: int = 64) -> datasets.DatasetDict:
    docs = datasets.Dataset.from_dict(documents(max_bytes))
    held = np.arange(len(docs)) % HOLD_OUT == 0
    split = datasets.DatasetDict(train=docs.select(np.flatnonzero(~held)), val=docs.select(np.flatnonzero(held)))
    cut = split.map(windows, batched=True, remove_columns=["name", "text"], fn_kwargs={"seq_len": seq_len})
    cut.save_to_disk(str(out))
    return cut


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-bytes", type=int, default=400_000)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    made = make(args.out, args.max_bytes, args.seq_len)
    print(f"{args.out}: {len(made['train'])} train / {len(made['val'])} val windows of {args.seq_len + 1} bytes")
