"""Finding, calling and checking a recipe: ``recipe: module:function`` (or ``gpt``) with ``recipe_args``.

Every problem is a one-paragraph ``UserError`` naming the recipe (and the key or rank): a module that does not
import, a missing or non-callable attribute, arguments the recipe rejects, a result that is not a ``Recipe``, a
model without parameters, a dataset that is empty or shorter than one global batch. The module is imported from
the run directory's code snapshot when there is one (``rundir.snapshot.activate`` put it first on ``sys.path``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from runconfig.schema import BUILTIN_RECIPE
from trainer.errors import UserError, first_line
from trainer.recipes.api import Recipe, RecipeContext

BUILTIN_PATH = "trainer.recipes.gpt:recipe"


def recipe_function(spec: str) -> Callable[..., Any]:
    """The callable a ``recipe:`` value names."""
    module_name, _, attr = (BUILTIN_PATH if spec == BUILTIN_RECIPE else spec).partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, SyntaxError, or anything the module's top level raised
        where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, SyntaxError) else ""
        raise UserError(
            f"recipe {spec!r}: module {module_name!r} does not import{where}: {first_line(exc)}. The module is "
            "looked for in the run directory's code snapshot (taken at submit from the config file's folder, its "
            "parent or the current folder) and in the installed packages.",
            collective=True,
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:12]
        raise UserError(
            f"recipe {spec!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no attribute "
            f"{attr!r} (its public callables: {', '.join(names) or 'none'}).",
            collective=True,
        )
    if not callable(fn):
        raise UserError(f"recipe {spec!r}: {attr!r} is a {type(fn).__name__}, not a function.", collective=True)
    return fn


def build_recipe(spec: str, args: dict[str, Any], ctx: RecipeContext) -> Recipe:
    """Call the recipe function with ``ctx`` and ``args`` and check what it returns."""
    fn = recipe_function(spec)
    try:
        inspect.signature(fn).bind(ctx, **args)
    except TypeError as exc:
        raise UserError(
            f"recipe {spec!r} does not take these recipe_args: {exc} (recipe_args: {sorted(args)}; its signature: "
            f"{spec.partition(':')[2] or spec}{inspect.signature(fn)}).",
            collective=True,
        ) from None
    except ValueError:
        pass  # no signature to inspect (a builtin): let the call say
    try:
        recipe = fn(ctx, **args)
    except UserError:
        raise
    except (ValueError, TypeError) as exc:
        raise UserError(f"recipe {spec!r} rejected its recipe_args: {first_line(exc)}.", collective=True) from None
    check_recipe(spec, recipe)
    return recipe


def check_recipe(spec: str, recipe: Any) -> None:
    """What can be checked of a recipe's result without running it."""
    if not isinstance(recipe, Recipe):
        raise UserError(
            f"recipe {spec!r} returned {type(recipe).__name__}, not a trainer.recipes.Recipe (return "
            "Recipe(model=..., train_data=..., loss=...)).",
            collective=True,
        )
    if not isinstance(recipe.model, torch.nn.Module):
        raise UserError(
            f"recipe {spec!r}: Recipe.model is a {type(recipe.model).__name__}, not a torch.nn.Module.",
            collective=True,
        )
    if not any(p.requires_grad for p in recipe.model.parameters()):
        raise UserError(
            f"recipe {spec!r}: the model ({type(recipe.model).__name__}) has no trainable parameters.",
            collective=True,
        )
    if not callable(recipe.loss):
        raise UserError(f"recipe {spec!r}: Recipe.loss is not callable.", collective=True)
    for name in ("train_data", "eval_data"):
        ds = getattr(recipe, name)
        if ds is None and name == "eval_data":
            continue
        if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
            raise UserError(
                f"recipe {spec!r}: Recipe.{name} ({type(ds).__name__}) is not a map-style dataset (it needs "
                "__len__ and __getitem__).",
                collective=True,
            )
    for name in ("collate", "optimizer", "lr_schedule", "eval_metrics"):
        value = getattr(recipe, name)
        if value is not None and not callable(value):
            raise UserError(f"recipe {spec!r}: Recipe.{name} is not callable.", collective=True)
    if not recipe.units_per_sample > 0:
        raise UserError(f"recipe {spec!r}: Recipe.units_per_sample must be > 0.", collective=True)


def check_lengths(spec: str, recipe: Recipe, *, global_batch: int) -> None:
    n = len(recipe.train_data)
    if n == 0:
        raise UserError(f"recipe {spec!r}: train_data is empty (length 0).", collective=True)
    if n < global_batch:
        raise UserError(
            f"recipe {spec!r}: train_data holds {n} samples, fewer than one global batch "
            f"(train.global_batch_size={global_batch}).",
            collective=True,
        )
    if recipe.eval_data is not None and len(recipe.eval_data) == 0:
        raise UserError(f"recipe {spec!r}: eval_data is empty (length 0); leave it unset for no eval.", collective=True)
