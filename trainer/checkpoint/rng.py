"""The random streams of a rank: captured into and restored from its checkpoint file, or seeded afresh."""

from __future__ import annotations

import random

import numpy as np
import torch

from trainer.checkpoint.state import rank_seed


def rng_state() -> dict:
    """This process's python, numpy, torch (and CUDA) generator states, as tensors and plain values that
    ``torch.load(weights_only=True)`` reads back."""
    key, pos, has_gauss, cached = np.random.get_state(legacy=True)[1:]
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "cached": cached},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_rank(seed: int, rank: int, step: int = 0) -> None:
    """Seed python, numpy and torch with rank ``rank``'s streams from ``step`` on (``rank_seed``)."""
    value = rank_seed(seed, rank, step)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)
