"""Tensor parallelism for any recipe's model: the recipe's plan applied with ``parallelize_module`` on the layout's
``tp`` mesh dimension (innermost: the ranks of one group are on one node). Torch's own parallel styles do the
sharding; this module checks what torch leaves to the caller: a plan at all, a plan that covers every parameter
(a plain parameter in a tensor-parallel model would get no gradient reduction across the group, so it could
silently drift apart), and weights that were tied before it (``parallelize_module`` replaces each parameter by a
new DTensor one, which unties an embedding and its output head)."""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.errors import UserError, first_line


def tensor_parallel(
    model: nn.Module,
    plan_of: Callable[[nn.Module], Mapping[str, Any]] | None,
    mesh: DeviceMesh,
    *,
    recipe: str,
    split_output: str | None = None,
) -> None:
    """Parallelize ``model`` in place over the 1-D ``mesh``. ``split_output``: the module path (the recipe's
    ``output_layer``, under ``parallel.loss_parallel``) whose output stays split by class, a DTensor, for the loss."""
    if plan_of is None:
        raise UserError(
            f"parallel.tp={mesh.size()}: recipe {recipe!r} gives no tensor-parallel plan. Give its Recipe a "
            "tp_plan (model -> {module path: ColwiseParallel()/RowwiseParallel()/...}, see trainer/recipes/api.py "
            "and the built-in GPT's trainer.models.gpt.tp_plan), or shard the model with parallel.dp_shard instead."
        )
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    ties = tied_groups(model)
    try:
        plan = dict(plan_of(model))
        paths = [path.split(".") for path, _ in model.named_modules() if path]
        if split_output is not None and split_output.split(".") in paths:  # a pipeline stage may not hold it
            plan[split_output] = _split_output(plan.get(split_output), split_output, recipe=recipe)
        for key in plan:  # parallelize_module only warns about a key that matches nothing: a typo does nothing
            if not any(_matches(key.split("."), path) for path in paths):
                raise ValueError(f"the key {key!r} matches no module of the model")
        parallelize_module(model, mesh, plan)
    except (ValueError, TypeError, AttributeError, RuntimeError) as exc:
        raise UserError(
            f"parallel.tp={mesh.size()}: recipe {recipe!r}'s tp_plan could not be applied: {first_line(exc)}"
        ) from None
    retie(model, ties)
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        shown = ", ".join(plain[:6]) + (f" and {len(plain) - 6} more" if len(plain) > 6 else "")
        raise UserError(
            f"parallel.tp={mesh.size()}: recipe {recipe!r}'s tp_plan leaves parameters outside tensor parallelism: "
            f"{shown}. Add their modules to the plan (e.g. SequenceParallel() for a norm between parallel layers, "
            "RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()) for an embedding)."
        )


def plain_loss(loss: Any) -> Any:
    """The loss as a plain tensor where loss parallelism made it a (replicated) DTensor; autograd runs through."""
    from torch.distributed.tensor import DTensor

    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _split_output(style: Any, path: str, *, recipe: str) -> Any:
    """The recipe's ColwiseParallel for its output layer, keeping the output split along the last (class)
    dimension as a DTensor, which torch's ``loss_parallel()`` takes (torchtitan's plan under loss parallelism)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    if not isinstance(style, ColwiseParallel):
        what = "no entry" if style is None else f"{type(style).__name__}"
        raise UserError(
            f"parallel.loss_parallel: recipe {recipe!r}'s output_layer {path!r} has {what} in its tp_plan; loss "
            "parallelism splits that layer's output by class, which needs ColwiseParallel() there."
        )
    style = copy.copy(style)
    style.output_layouts, style.use_local_output = (Shard(-1),), False
    return style


def _matches(key: list[str], path: list[str]) -> bool:
    """parallelize_module's matching: one ``fnmatch`` pattern per path component."""
    return len(key) == len(path) and all(fnmatch.fnmatchcase(p, k) for k, p in zip(key, path, strict=True))


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one object, grouped (model order)."""
    seen: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
    return [names for names in seen.values() if len(names) > 1]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make each group (``tied_groups`` of the model before something replaced its parameters) one parameter
    again: the first name's (new) one."""
    for names in groups:
        owner, attr = _split(model, names[0])
        for name in names[1:]:
            module, leaf = _split(model, name)
            setattr(module, leaf, getattr(owner, attr))


def _split(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf
