"""Start-up, the recipe: the user's model, data and loss built on every rank (``RecipeContext``), its
structure checked once on rank 0."""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch.utils.data import default_collate

from runconfig import RunConfig
from rundir import RunDir
from storage.objstore import Store
from trainer.data.resolve import open_splits
from trainer.env import RuntimeEnv, agree, patient_barrier
from trainer.errors import UserError, first_line
from trainer.parallel.distributed import Distributed
from trainer.parallel.materialise import params_on_meta
from trainer.recipes.api import Recipe, RecipeContext
from trainer.recipes.load import build_recipe, check_lengths

log = logging.getLogger("trainer")
STRUCTURE_SAMPLES = 8  # items compared for one structure at start-up (default collate only)


def make_recipe(
    cfg: RunConfig,
    env: RuntimeEnv,
    distributed: Distributed,
    rundir: RunDir,
    comm: MPI.Comm,
    stack: contextlib.ExitStack,
) -> Recipe:
    """Seed torch with train.seed (same initial weights on every rank) and build the recipe. Collective: every rank
    gets the recipe or the same UserError (the first failing rank's)."""
    ctx = recipe_context(cfg, env, distributed.device, rundir.root, comm, stack)
    torch.manual_seed(cfg.train.seed)
    recipe, error = None, None
    try:
        with params_on_meta() if cfg.parallel.meta_init else contextlib.nullcontext():
            recipe = build_recipe(cfg.recipe, dict(cfg.recipe_args), ctx)
        check_lengths(cfg.recipe, recipe, global_batch=cfg.train.global_batch_size)
    except UserError as exc:
        error = str(exc)
    agree(comm, error)
    return recipe


def recipe_context(
    cfg: RunConfig, env: RuntimeEnv, device: torch.device, run_dir: Path, comm: MPI.Comm, stack: contextlib.ExitStack
) -> RecipeContext:
    """What the recipe is told on this rank; its token data is opened on first use and closed with ``stack``."""

    def token_data(seq_len: int, vocab_size: int | None):
        train, val = open_splits(cfg.data, seq_len, vocab_size, env, comm, Store(cfg.storage))
        stack.callback(train.close)
        stack.callback(val.close)
        if train.cache is not None:
            stack.callback(train.cache.close)
        return train, val

    return RecipeContext(
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        seed=cfg.train.seed,
        device=device,
        micro_batch_size=cfg.train.micro_batch_size,
        config=cfg,
        run_dir=run_dir,
        cache_dir=env.data_cache,
        _barrier=functools.partial(patient_barrier, comm),  # the others wait without spinning on rank 0's cores
        _token_data=token_data,
    )


def structure(x: Any) -> Any:
    """The shape of an item for comparison: types, tensor/array shapes and dtypes, nested."""
    if isinstance(x, torch.Tensor | np.ndarray):
        return f"{type(x).__name__}{list(x.shape)} {x.dtype}"
    if isinstance(x, dict):
        return {k: structure(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, list | tuple):
        return [structure(v) for v in x]
    return type(x).__name__


def check_structure(spec: str, recipe: Recipe) -> None:
    """Items of a dataset batched by the default collate must share one structure: compare a few, evenly spaced."""
    for name in ("train_data", "eval_data"):
        data = getattr(recipe, name)
        if data is None or recipe.collate not in (None, default_collate):
            continue
        spread = np.linspace(0, len(data) - 1, STRUCTURE_SAMPLES).astype(np.int64)
        ids = np.unique(np.concatenate([np.arange(min(4, len(data))), spread]))  # neighbours and far ones
        first = None
        for i in ids:
            try:
                item = structure(data[int(i)])
            except UserError:
                raise
            except Exception as exc:
                raise UserError(f"recipe {spec!r}: {name}[{int(i)}] raised {first_line(exc)}") from None
            if first is None:
                first = (int(i), item)
            elif item != first[1]:
                raise UserError(
                    f"recipe {spec!r}: {name} items differ in structure, shape or dtype: item {first[0]} is "
                    f"{first[1]}, item {int(i)} is {item}. Items batched by the default collate must match (or give "
                    "the recipe a collate function that pads)."
                )
