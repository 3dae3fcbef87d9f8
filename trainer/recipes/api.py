"""The recipe interface: how a user's model, data and loss enter the trainer (the built-in GPT uses it too).

A recipe is a function named in the config as ``recipe: module:function`` (``recipe: gpt`` for the built-in one),
called once per rank as ``function(ctx, **recipe_args)`` and returning a :class:`Recipe`::

    from trainer.recipes import Recipe, RecipeContext

    def recipe(ctx: RecipeContext, hidden: int = 64) -> Recipe:
        model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
        return Recipe(
            model=model,
            train_data=MyDataset("train"),          # map-style: __len__ and __getitem__
            loss=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
            eval_data=MyDataset("val"),
        )

What the trainer does with it: :class:`Recipe`. Raise ``ValueError`` (or ``TypeError``) for ``recipe_args`` the
recipe rejects: the message is shown with the recipe named, and the job ends with status 2 before any training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.errors import UserError

#: (model, batch) -> the mean loss of the batch, a scalar tensor. ``model`` is the DDP-wrapped model: call it.
LossFn = Callable[[nn.Module, Any], torch.Tensor]
#: (model, batch) -> named per-batch means, e.g. {"accuracy": ...}; reported as eval_<name> (sample-weighted).
MetricsFn = Callable[[nn.Module, Any], Mapping[str, Any]]


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """How a recipe's model runs as a pipeline (``parallel.pp`` > 1). The built-in GPT's is
    ``trainer.models.gpt.pipeline``."""

    stage: Callable[[nn.Module, int, int], nn.Module]
    """(model, stage, stages) -> the part of the model that stage ``stage`` (0-based) of ``stages`` runs: a module
    whose forward takes the previous stage's output (the first stage: the model input) and returns the next
    stage's input (the last stage: the model output). It must keep the parameter names of the whole model (e.g.
    ``blocks.3.mlp.weight``: hold the kept blocks in an ``nn.ModuleDict`` keyed by their index), so checkpoints
    move between layouts. Weights tied across stages (an embedding and its output head) are kept equal by the
    trainer: their gradients are summed over the stages that hold them."""
    split: Callable[[Any], tuple[torch.Tensor, Any]]
    """batch -> (the model's input tensor, the targets the loss compares its output with)."""
    loss: Callable[[Any, Any], torch.Tensor]
    """(model output, targets) -> the mean loss, as ``Recipe.loss`` computes it from the same batch."""


@dataclass(frozen=True, kw_only=True)
class ContextParallel:
    """How a recipe's model runs with each sequence split over ranks (``parallel.cp`` > 1). The trainer splits
    the batch into the model's input and targets, cuts both along dimension 1 (the sequence) into 2 cp chunks, hands
    each rank a head and a tail chunk, and calls the model and ``loss`` on its part inside torch's
    ``context_parallel()``, which makes ``F.scaled_dot_product_attention`` (causal, no mask) attend over the whole
    sequence. The model must read token positions from :func:`positions` (not ``torch.arange``), and take its
    sizes from its input. The built-in GPT's is ``trainer.models.gpt.context_parallel``."""

    split: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
    """batch -> (the model's input, the targets the loss compares its output with), both [batch, sequence, ...]."""
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    """(model output, targets) -> the mean loss over this rank's tokens, as ``Recipe.loss`` computes it over all of
    them. Every rank holds as many tokens, so the mean of the ranks' losses is the batch's: a loss that leaves
    tokens out (``ignore_index``, padding) would weigh the ranks unevenly."""


_positions: torch.Tensor | None = None  # this rank's token positions while the trainer runs a context-parallel step


def positions(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The positions in the whole sequence of the ``length`` tokens a model's forward holds: ``torch.arange(length)``,
    or under context parallelism (``parallel.cp``) this rank's chunks' positions. Models with position embeddings
    (or rotary tables) index them with this."""
    if _positions is not None and _positions.numel() == length:
        return _positions.to(device)
    return torch.arange(length, device=device)


@dataclass(kw_only=True)
class Recipe:
    """What a recipe returns. Only ``model``, ``train_data`` and ``loss`` are required.

    The trainer does the rest: it seeds torch with ``train.seed`` before calling the recipe (so every rank builds
    the same initial weights), places and wraps the model for the parallel layout, splits a global sample order (a
    pure function of ``data.seed`` and the epoch, independent of the world size) over ranks and micro-batches,
    prefetches batches, steps the optimizer, checkpoints and resumes exactly."""

    model: nn.Module
    """A plain ``torch.nn.Module`` with parameters, built on the CPU (the trainer moves it to the device)."""
    train_data: Any
    """A map-style dataset: ``len(ds)`` and ``ds[i]`` for ``0 <= i < len(ds)``; items are tensors, numpy arrays,
    numbers, or tuples/dicts of them, batched by ``collate``. ``ds[i]`` must depend on ``i`` only (no randomness
    of its own): the trainer's order and resume guarantees rest on it."""
    loss: LossFn
    """(model, batch) -> scalar loss tensor, the mean over the batch. Called under autocast on GPU (bf16)."""
    eval_data: Any | None = None
    """Held-out map-style dataset; ``train.eval_sequences`` evenly spaced items of it are evaluated every
    ``train.eval_every`` steps. Reported: ``eval_loss`` (the loss, sample-weighted mean over ranks)."""
    eval_metrics: MetricsFn | None = None
    """Extra eval numbers per batch (means over the batch), reported as ``eval_<name>``."""
    collate: Callable[[list], Any] | None = None
    """list of items -> batch; default ``torch.utils.data.default_collate`` (stacks arrays into tensors)."""
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    """model -> optimizer; default AdamW from ``train.*`` (decay on matrices only)."""
    lr_schedule: Callable[[int], float] | None = None
    """optimizer step (0-based) -> learning rate, set on every param group before the step (times the group's
    ``lr_scale`` if it has one); default: linear warmup + cosine decay from ``train.*``. Must be a pure function of
    the step: resume needs nothing else."""
    flops_per_sample: float | None = None
    """Training FLOPs of one sample (forward + backward) for MFU; default: counted once with
    ``torch.utils.flop_counter.FlopCounterMode`` on one micro-batch (only when MFU is reported: on GPU)."""
    unit: str = "samples"
    """What throughput counts, e.g. "tokens" or "images": the log line shows ``<unit>/s``."""
    units_per_sample: float = 1.0
    """Units in one sample (a language model's window of seq_len tokens: seq_len)."""
    fsdp_wrap: Sequence[type] | None = None
    """Module classes that are the model's blocks: each is sharded on its own by FSDP2 (``parallel.dp_shard``)
    and is the unit of activation checkpointing. Default: each child of the model's largest ``nn.ModuleList``."""
    tp_plan: Callable[[nn.Module], Mapping[str, Any]] | None = None
    """model -> its tensor-parallel plan for ``parallel.tp`` > 1: ``{module path: ParallelStyle}`` as
    ``torch.distributed.tensor.parallel.parallelize_module`` takes it (``*`` matches one path component), e.g.
    ``{"layers.*.mlp.up": ColwiseParallel(), "layers.*.mlp.down": RowwiseParallel()}``. Every parameter must end
    up in it (norms in a sequence-parallel region: ``SequenceParallel()``); the model's forward must take its
    local sizes from the tensors (heads per rank = heads / tp). Called only when tensor parallelism is on.
    Parameters tied before (an embedding and its output head) are tied again after."""
    output_layer: str | None = None
    """Module path of the layer whose output the loss takes (a language model's head: ``"head"``), for
    ``parallel.loss_parallel``: its tp_plan entry (a ``ColwiseParallel``) then keeps the output split by class over
    the tensor-parallel group, and the loss runs on the pieces under torch's ``loss_parallel()``."""
    pipeline: Pipeline | None = None
    """How the model is cut into pipeline stages, and its loss on the last one (``parallel.pp`` > 1). Eval metrics
    (``eval_metrics``) are not computed under pipeline parallelism: they call the whole model."""
    context_parallel: ContextParallel | None = None
    """How the model runs with its sequences split over ranks (``parallel.cp`` > 1). Eval runs whole sequences on
    every rank of the group, outside it."""
    init_weights: Callable[[str, nn.Module], None] | None = None
    """(module path, module) -> None: fill the module's own parameters (not its children's) in place, for
    ``parallel.meta_init``, where the model is built without values. Called once per module that owns parameters,
    on full-size tensors, under ``torch.no_grad()`` with torch's generator seeded from ``train.seed`` and the path.
    Default: the module's ``reset_parameters()`` (torch's layers have one); a parameter left unset is refused."""
    architecture: Mapping[str, Any] = field(default_factory=dict)
    """Settings that define the model beyond its parameter shapes (e.g. attention heads). A resume across a
    change of these, of a parameter's name, shape or dtype, or of the optimizer's type is refused unless
    ``checkpoint.allow_shape_change`` (a warm start)."""


@dataclass(frozen=True, kw_only=True)
class RecipeContext:
    """What the trainer tells a recipe. Read-only facts, and the set-up helpers that must be collective."""

    rank: int
    world_size: int
    local_rank: int
    seed: int
    """``train.seed``; torch's global RNG is seeded with it just before the recipe is called."""
    device: torch.device
    """Where the model will be trained (informational: build on the CPU, the trainer moves it)."""
    micro_batch_size: int
    config: Any
    """The whole run config (``runconfig.RunConfig``), read-only: ``config.data``, ``config.train``..."""
    run_dir: Path
    cache_dir: Path
    """A folder for data the recipe prepares on first use and keeps across runs (``$HPC_DATA_CACHE``, default
    ``~/.cache/hpc-trainer/data``; the trainer's own prepared datasets live there too). It may be node-local: write
    a file there atomically (a temporary name, then ``os.replace``) and look for it on every rank."""
    _barrier: Callable[[], None] = lambda: None
    _token_data: Callable[..., tuple[Any, Any]] | None = None

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Rank 0 runs the block first, the other ranks after it (e.g. to build a cache on first use)."""
        if self.rank != 0:
            self._barrier()
        try:
            yield
        finally:
            if self.rank == 0:
                self._barrier()

    def open(self, path: str, mode: str = "rb") -> Any:
        """A file of the recipe's, by path or object-storage URL (``s3://bucket/key``, any fsspec URL), opened
        through the run's ``storage:`` section (endpoint; credentials from the environment): a file object for
        ``with``. A missing object, denied access or an unreachable store is a UserError naming the URL."""
        from storage.objstore import Store, StoreError, StoreUnavailable

        store = Store(self.config.storage)
        try:
            return store.call(lambda fs, p: fs.open(p, mode), path, what=f"rank {self.rank}: recipe file")
        except StoreUnavailable as exc:
            raise UserError(f"rank {self.rank}: recipe file {path}: {exc.strerror} (after storage.retries).") from None
        except StoreError as exc:
            raise UserError(str(exc)) from None

    def token_data(self, seq_len: int, *, vocab_size: int | None = None) -> tuple[Any, Any]:
        """(train, val) windows of ``seq_len + 1`` tokens from the prepared HDF5 token dataset of the ``data:``
        section (``data.path``, or ``data.source`` prepared on first use), checked against its manifest
        (``data.verify``). Each is a map-style dataset of int64 numpy arrays with ``.vocab_size`` from the
        manifest; ``vocab_size`` (the model's) must cover it. Collective: every rank calls it."""
        assert self._token_data is not None
        return self._token_data(seq_len, vocab_size)
