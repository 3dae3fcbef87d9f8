"""Whether a checkpoint fits the run that loads it: its format, and the model and optimizer it was saved with; a
forced warm start across a change (``checkpoint.allow_shape_change``)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.errors import UserError

log = logging.getLogger(__name__)
#: The format this trainer writes: 4, the optimizer state flattened per parameter (a pipeline stage's param groups
#: list only its own parameters: as one list per group, stages would overwrite each other's).
FORMAT = 4
#: Formats it reads: 2 differs only in its params_sha256 (fingerprint.params_sha256_v1), 3 in its nested optimizer
#: state.
READABLE = (2, 3, 4)

Changes = dict[str, tuple | str]  # what differs from the checkpoint: (saved, now), or a description


def options(fmt: int = FORMAT, **more) -> StateDictOptions:
    """How a checkpoint of format ``fmt`` holds the model and optimizer state (DCP state dicts)."""
    return StateDictOptions(flatten_optimizer_state_dict=fmt >= 4, **more)


def check_compatible(
    manifest: dict, path: Path, identity: dict, optimizer: torch.optim.Optimizer, *, allow_shape_change: bool
) -> Changes:
    """What identifies the model and optimizer and differs from the checkpoint's: the recipe, its architecture
    settings, a parameter's name, shape or dtype, the optimizer's type. Refused unless allow_shape_change. (Dropout
    and other settings that change no tensor are not part of it.) ``identity``: the run's recipe, architecture and
    parameter shapes, as its manifests record them."""
    if manifest.get("format") not in READABLE:
        raise UserError(
            f"checkpoint {path} has format {manifest.get('format')}, this trainer reads formats "
            f"{', '.join(map(str, READABLE))}; resume "
            "it with the trainer version that wrote it, or start a new run directory. Nothing was deleted.",
            collective=True,
        )
    changed: Changes = {}
    if manifest["recipe"] != identity["recipe"]:
        changed["recipe"] = (manifest["recipe"], identity["recipe"])
    saved_arch, arch = manifest["architecture"], identity["architecture"]
    for key in [*arch, *(k for k in saved_arch if k not in arch)]:
        if saved_arch.get(key) != arch.get(key):
            changed[key] = (saved_arch.get(key), arch.get(key))
    saved, now = manifest["param_shapes"], identity["param_shapes"]
    differ = {
        "new": sorted(set(now) - set(saved)),
        "gone": sorted(set(saved) - set(now)),
        "reshaped": sorted(n for n in set(now) & set(saved) if now[n] != saved[n]),
    }
    if any(differ.values()):
        changed["parameters"] = "; ".join(
            f"{len(names)} {kind} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            for kind, names in differ.items()
            if names
        )
    if manifest["optimizer"]["type"] != type(optimizer).__name__:
        changed["optimizer"] = (manifest["optimizer"]["type"], type(optimizer).__name__)
    if changed and not allow_shape_change:
        raise UserError(
            f"checkpoint {path} was saved with another model or optimizer ({describe_changes(changed)}); refusing to "
            "resume. "
            "Set checkpoint.allow_shape_change=true to force it (a warm start: tensors whose shape still "
            "matches are loaded, the rest keep their fresh initialisation), or use a new run directory. "
            "Nothing was deleted.",
            collective=True,
        )
    return changed


def warm_start(
    path: Path,
    changed: Changes,
    fmt: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    group,
    rank: int,
) -> None:
    """Forced resume across a model/optimizer change: load every parameter whose name and shape still match.

    The optimizer state is loaded only when every parameter loaded and the optimizer type is unchanged;
    otherwise it starts fresh (its moments would belong to other tensors).
    """
    msd, osd = get_state_dict(model, optimizer, options=options(fmt))
    saved = dcp.FileSystemReader(path / "dcp").read_metadata().state_dict_metadata
    fits = {
        k: v
        for k, v in msd.items()
        if (m := saved.get(f"model.{k}")) is not None and tuple(getattr(m, "size", ())) == tuple(v.shape)
    }
    fresh = sorted(set(msd) - set(fits))
    with_optim = not fresh and "optimizer" not in changed
    state = {"model": fits, "optim": osd} if with_optim else {"model": fits}
    dcp.load(state, checkpoint_id=path / "dcp", process_group=group)
    set_model_state_dict(model, fits, options=options(fmt, strict=False))
    if with_optim:
        set_optimizer_state_dict(model, optimizer, osd, options=options(fmt))
    if rank == 0:
        log.warning(
            "checkpoint.allow_shape_change: resuming from %s across a change (%s): loaded %d of %d tensors%s; "
            "optimizer state %s",
            path.name,
            describe_changes(changed),
            len(fits),
            len(msd),
            f", fresh initialisation kept for {fresh}" if fresh else "",
            "loaded" if with_optim else "reset",
        )


def describe_changes(changed: Changes) -> str:
    items = [f"{k}: {v}" if isinstance(v, str) else f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in changed.items()]
    return ", ".join(items[:6]) + (f" and {len(items) - 6} more" if len(items) > 6 else "")


def renamed(osd: dict, names: dict[str, str]) -> dict:
    """An optimizer state dict (as ``get_state_dict`` gives it: FQN-keyed, flattened per parameter or nested) with
    parameters renamed."""
    if not names:
        return osd
    if "state" in osd and "param_groups" in osd:  # nested (format 3)
        state = {names.get(k, k): v for k, v in osd["state"].items()}
        groups = [{**g, "params": [names.get(n, n) for n in g["params"]]} for g in osd["param_groups"]]
        return {"state": state, "param_groups": groups}
    out = {}
    for key, value in osd.items():  # "state.<fqn>.<name>", "param_groups.<fqn>.<name>"
        kind, _, rest = key.partition(".")
        fqn, _, leaf = rest.rpartition(".")
        out[f"{kind}.{names.get(fqn, fqn)}.{leaf}"] = value
    return out


def optim_key(node: int | None) -> str:
    """DCP's key of a rank's optimizer state: "optim", or with comm.sync rounds its node's own."""
    return "optim" if node is None else f"optim_node{node:05d}"


def without(osd: dict, names: Collection[str]) -> dict:
    """An optimizer state dict (flattened or nested, as ``renamed``) without these parameters' entries."""
    if not names:
        return osd
    if "state" in osd and "param_groups" in osd:
        state = {k: v for k, v in osd["state"].items() if k not in names}
        groups = [{**g, "params": [n for n in g["params"] if n not in names]} for g in osd["param_groups"]]
        return {"state": state, "param_groups": groups}
    return {k: v for k, v in osd.items() if k.partition(".")[2].rpartition(".")[0] not in names}


def with_copies(osd: dict, twins: dict[str, str]) -> dict:
    """``osd`` with an entry for each twin (a copy of a tied weight held apart on this rank) cloned from the entry
    of the name it copies: {twin: whole-model name}."""
    if not twins:
        return osd

    def clone(v: Any) -> Any:
        return v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)

    if "state" in osd and "param_groups" in osd:
        state = dict(osd["state"])
        groups = [{**g, "params": list(g["params"])} for g in osd["param_groups"]]
        for twin, whole in twins.items():
            if whole in osd["state"]:  # a weight with no state yet (never stepped, or frozen) has none to copy
                state[twin] = {k: clone(v) for k, v in osd["state"][whole].items()}
            if groups and not any(twin in g["params"] for g in groups):
                next((g for g in groups if whole in g["params"]), groups[0])["params"].append(twin)
        return {"state": state, "param_groups": groups}
    out = dict(osd)
    for key, value in osd.items():
        kind, _, rest = key.partition(".")
        fqn, _, leaf = rest.rpartition(".")
        for twin in (t for t, w in twins.items() if w == fqn):
            out[f"{kind}.{twin}.{leaf}"] = clone(value)
    return out
