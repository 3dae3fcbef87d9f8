"""Meta-device initialisation (``parallel.meta_init``): no rank ever holds the whole model.

The recipe builds its model as usual, but every parameter is moved to the meta device as it is registered (shapes
and dtypes, no memory; buffers stay real: they are small and often computed, e.g. rotary tables). The trainer then
splits the model for the layout (pipeline cut, tensor parallelism, FSDP2) while it is still on meta, allocates
only what this rank keeps, and fills it (``materialise``).

Initial values come module by module: each module that owns parameters is initialised on a full-size temporary
copy of its own parameters, by the recipe's ``init_weights(path, module)`` (default: the module's
``reset_parameters()``), with torch's generator seeded from ``train.seed`` and the module's path; each rank then
keeps its shard of the result. So the initial weights are the same in every layout (DDP, FSDP, TP, PP and their
mixes: a resharded run starts where the unsharded one does), and no rank holds more than one module's parameters
at a time. They differ from an eager build's, which draws every module from one stream in construction order.
Weights tied to each other (an embedding and its output head) are initialised once, by the module that registers
them first, and each copy (a pipeline stage's) takes that value.

The cost: each rank generates the full values of the modules it holds a part of (on its device: fast on a GPU),
work proportional to the model once per fresh run; resumed runs overwrite them from the checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from trainer.errors import first_line
from trainer.parallel.tp import retie, tied_groups

InitFn = Callable[[str, nn.Module], None]


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Within the block, every parameter registered on a module goes to the meta device (a tie stays a tie: the
    second registration of a meta parameter is left as it is). Initialisation code in constructors then runs on
    meta tensors, as a no-op."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move the (real) buffers of a model whose parameters are on meta."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def owners(model: nn.Module) -> list[tuple[str, nn.Module, list[list[str]]]]:
    """(module path, module, [names in the whole model of each of its own parameters: the first is the canonical
    one, the others tied copies]) for every module that registers a parameter first, in model order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    seen: set[int] = set()
    out = []
    for path, module in model.named_modules(remove_duplicate=False):
        own = []
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                own.append(names[id(p)])
        if own:
            out.append((path, module, own))
    return out


def _lookup(model: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter registered under ``name`` now (after sharding: the DTensor), or None where the module path is
    gone."""
    path, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    return module._parameters.get(leaf)


def module_seed(seed: int, path: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def materialise(
    model: nn.Module,
    plan: list[tuple[str, nn.Module, list[list[str]]]],
    init: InitFn | None,
    *,
    seed: int,
    device: torch.device,
    spec: str,
    host: bool = False,
) -> str | None:
    """Allocate this rank's part of ``model`` (its parameters still on meta, already split for the layout) on
    ``device`` and fill it from a module-by-module initialisation (``plan``: ``owners`` of the whole model,
    taken before it was split). Returns an error message (for every rank to agree on), or None. ``host``: the
    parameters' memory is the host's (parallel.offload), the values are computed on ``device`` as without it."""
    _allocate(model, torch.device("cpu") if host else device)
    buffers_to(model, device)  # a module's buffers stay with its computation
    for path, module, groups in plan:
        # This rank's copies of each parameter the module owns (none: another pipeline stage's module).
        held = [[p for p in map(functools.partial(_lookup, model), names) if p is not None] for names in groups]
        held = [[p for p in copies if p.device.type != "meta"] for copies in held]
        if not any(held):
            continue
        temp, error = _initialised(path, module, init, seed=seed, device=device, spec=spec)
        if error is not None:
            return error
        for names, copies in zip(groups, held, strict=True):
            full = temp._parameters[names[0].rpartition(".")[2]]
            if torch.isnan(full).any():
                how = (
                    "the recipe's init_weights(path, module) left it unset"
                    if init is not None
                    else f"{type(module).__name__} has no reset_parameters() and the recipe gives no init_weights"
                )
                return (
                    f"parallel.meta_init: recipe {spec!r}: parameter {names[0]!r} was not initialised ({how}). "
                    "Give the Recipe init_weights=fn, where fn(path, module) fills the module's own parameters "
                    "in place, or turn parallel.meta_init off."
                )
            _keep_pieces(copies, full)
    return None


def _allocate(model: nn.Module, device: torch.device) -> None:
    """Memory on ``device`` for the parameters this rank holds, keeping the ties and the buffers' values."""
    ties = tied_groups(model)
    saved = {name: b.clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)  # new parameter objects where they were plain: ties are lost
    retie(model, ties)
    for name, b in model.named_buffers():  # to_empty leaves garbage in buffers too: put them back
        if name in saved:
            b.copy_(saved[name])


def _initialised(
    path: str, module: nn.Module, init: InitFn | None, *, seed: int, device: torch.device, spec: str
) -> tuple[nn.Module, str | None]:
    """A copy of ``module`` with full-size parameters of its own, initialised from the module's seed (NaN where the
    initialisation left one unset), and the error message where the initialisation raised."""
    temp = copy.copy(module)
    temp._parameters = {
        k: None if p is None else nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype, device=device))
        for k, p in module._parameters.items()
    }
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
        torch.manual_seed(module_seed(seed, path))
        try:
            if init is not None:
                init(path, temp)
            elif hasattr(temp, "reset_parameters"):
                temp.reset_parameters()
        except Exception as exc:
            what = "init_weights" if init is not None else f"{type(module).__name__}.reset_parameters()"
            return temp, f"parallel.meta_init: recipe {spec!r}: {what} failed on module {path!r}: {first_line(exc)}"
    return temp, None


def _keep_pieces(copies: list[torch.Tensor], full: torch.Tensor) -> None:
    """Each copy of a parameter keeps its piece of the whole value ``full`` (no communication)."""
    from torch.distributed.tensor import DTensor, Replicate

    for param in copies:
        if isinstance(param, DTensor):
            whole = DTensor.from_local(full, param.device_mesh, [Replicate()] * param.device_mesh.ndim, run_check=False)
            param.to_local().copy_(whole.redistribute(param.device_mesh, param.placements).to_local())
        else:
            param.copy_(full)
