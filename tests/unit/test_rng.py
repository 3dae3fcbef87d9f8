"""A rank's random streams: captured and restored exactly, and seeded from (seed, rank, step) in one place."""

import random

import numpy as np
import torch

from trainer.checkpoint.rng import rng_state, seed_rank, set_rng_state


def draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_seeding_is_a_function_of_seed_rank_and_step():
    seed_rank(5, 1, 10)
    first = draws()
    seed_rank(5, 1, 10)
    assert draws() == first
    seed_rank(5, 2, 10)
    other_rank = draws()
    seed_rank(5, 1, 11)
    other_step = draws()
    assert len({first, other_rank, other_step}) == 3


def test_a_captured_state_restores_every_stream():
    seed_rank(0, 0)
    draws()
    saved = rng_state()
    expected = draws()
    seed_rank(9, 3)
    set_rng_state(saved)
    assert draws() == expected
