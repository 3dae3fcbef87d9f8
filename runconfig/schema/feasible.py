"""Whether the run can be laid out at all: at the job's size, and at every smaller size job.min_nodes lets it
continue on, the layout resolves and the batch, the pipeline stages and the built-in GPT split over it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runconfig.layout import Layout, LayoutError
from runconfig.schema.fields import Problems
from runconfig.schema.recipe import BUILTIN_RECIPE

if TYPE_CHECKING:
    from runconfig.schema.run import RunConfig


def layout_problems(cfg: RunConfig) -> Problems:
    """The first problem at the job's size or at a size it may shrink to (largest first), or none."""
    job = cfg.job
    for nodes in range(job.nodes, job.min_nodes_or_all - 1, -1):
        shrunk = nodes < job.nodes
        world = nodes * job.ranks_per_node
        where = f"on {nodes} of job.nodes={job.nodes} (job.min_nodes={job.min_nodes}), " if shrunk else ""
        try:
            layout = cfg.layout(world)
        except LayoutError as exc:
            key = "job.min_nodes" if shrunk else f"parallel.{exc.key}"
            return [(key, f"{where}{exc} (world size {world} = {nodes} nodes x {job.ranks_per_node} ranks)")]
        problems = (
            _compress_problems(cfg, layout)
            or (_pipeline_problems(cfg, layout) if layout.pp > 1 and not shrunk else [])
            or _tensor_parallel_problems(cfg, layout, where)
            or _batch_problems(cfg, layout, nodes)
        )
        if problems:
            return problems
    return []


def _compress_problems(cfg: RunConfig, layout: Layout) -> Problems:
    if cfg.comm.compress != "none" and layout.uses_mesh:
        return [
            (
                "comm.compress",
                f"{cfg.comm.compress} compresses DDP's gradient all-reduce; the {layout.kind} layout "
                "reduces gradients through FSDP2 (set comm.compress: none)",
            )
        ]
    return []


def _pipeline_problems(cfg: RunConfig, layout: Layout) -> Problems:
    """Pipeline micro-batches that fit the stages and the loop's micro-batch; whole micro-batches to evaluate; a
    block per stage of the built-in GPT."""
    t, n = cfg.train, cfg.parallel.microbatches(layout.pp)
    if n < layout.pp:
        return [("parallel.pp_microbatches", f"{n} is fewer than the {layout.pp} pipeline stages")]
    if t.micro_batch_size % n:
        key = "parallel.pp_microbatches" if cfg.parallel.pp_microbatches else "parallel.pp"
        return [(key, f"{n} pipeline micro-batches do not divide train.micro_batch_size={t.micro_batch_size}")]
    if t.eval_every and t.eval_sequences < t.micro_batch_size * layout.dp:
        return [
            (
                "train.eval_sequences",
                f"{t.eval_sequences} is fewer than one micro-batch ({t.micro_batch_size}) per "
                f"data-parallel rank ({layout.dp}): a pipeline evaluates whole micro-batches",
            )
        ]
    if cfg.recipe == BUILTIN_RECIPE and layout.pp > cfg.model.n_layers:
        return [
            ("parallel.pp", f"{layout.pp} stages for model.n_layers={cfg.model.n_layers}: each stage needs a block")
        ]
    return []


def _tensor_parallel_problems(cfg: RunConfig, layout: Layout, where: str) -> Problems:
    """The built-in GPT's heads and MLP units split evenly over a tensor-parallel group."""
    if cfg.recipe != BUILTIN_RECIPE or layout.tp == 1:
        return []
    m = cfg.model
    for what, size in (("model.n_heads", m.n_heads), ("model.mlp_ratio x model.d_model", m.mlp_ratio * m.d_model)):
        if size % layout.tp:
            return [
                (
                    "parallel.tp",
                    f"{where}{layout.tp} does not divide {what} = {size}: the built-in GPT's tensor "
                    "parallelism splits attention heads and MLP units evenly over the group",
                )
            ]
    return []


def _batch_problems(cfg: RunConfig, layout: Layout, nodes: int) -> Problems:
    """The global batch splits into whole micro-batches over the data-parallel ranks."""
    t, job = cfg.train, cfg.job
    if not t.global_batch_size % (t.micro_batch_size * layout.dp):
        return []
    world = nodes * job.ranks_per_node
    ranks = f"{nodes} nodes x {job.ranks_per_node} ranks = {world}"
    dp = f"data-parallel size ({ranks})" if layout.dp == world else f"data-parallel size {layout.dp}"
    if nodes < job.nodes:
        return [
            (
                "job.min_nodes",
                f"{job.min_nodes} lets the run continue on {nodes} node(s), where "
                f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                f"train.micro_batch_size ({t.micro_batch_size}) x the {dp}: the global batch could not "
                "stay the same",
            )
        ]
    over = f"world size ({ranks})" if layout.dp == world else f"{dp} ({layout.describe()})"
    return [
        (
            "train.global_batch_size",
            f"{t.global_batch_size} is not a multiple of train.micro_batch_size ({t.micro_batch_size}) x {over}",
        )
    ]
