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
            or (
                [("parallel.pp_stages_per_rank", "stages per rank cut a pipeline; parallel.pp is 1")]
                if layout.pp == 1 and cfg.parallel.pp_stages_per_rank > 1
                else []
            )
            or _tensor_parallel_problems(cfg, layout, where)
            or _context_parallel_problems(cfg, layout, where)
            or _placement_problems(cfg, layout, where)
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


SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # input and weight gradients apart
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # two stages per rank, placed in a V


def schedule_problem(kind: str, per_rank: int, pp: int, n: int) -> tuple[str, str] | None:
    """What torch's schedule ``kind`` refuses of ``per_rank`` stages on each of ``pp`` ranks and ``n`` pipeline
    micro-batches (torch.distributed.pipelining's own checks, said before the job starts), or None."""
    if n < pp:
        return ("parallel.pp_microbatches", f"{n} is fewer than the {pp} pipeline stages")
    if kind in ("1F1B", "GPipe"):
        if per_rank != 1:
            return ("parallel.pp_stages_per_rank", f"{per_rank} stages per rank need an interleaved or V schedule; "
                    f"parallel.pp_schedule={kind} runs one stage per rank")  # fmt: skip
        return None
    if kind in V_SCHEDULES and per_rank != 2:
        return ("parallel.pp_stages_per_rank", f"parallel.pp_schedule={kind} places exactly 2 stages on each rank "
                f"(a V); this config sets {per_rank}")  # fmt: skip
    if per_rank < 2:
        return ("parallel.pp_stages_per_rank", f"parallel.pp_schedule={kind} interleaves 2 or more stages on each "
                "rank; this config sets 1")  # fmt: skip
    if kind == "DualPipeV" and n < 2 * pp:
        return ("parallel.pp_microbatches", f"{n} is fewer than DualPipeV's 2 x pp = {2 * pp} stages")
    if kind in ("Interleaved1F1B", "InterleavedZeroBubble") and n % (n // pp):
        return ("parallel.pp_microbatches", f"{n} is not a multiple of the {n // pp} rounds of {pp} micro-batches "
                f"that {kind} runs (use a multiple of parallel.pp={pp})")  # fmt: skip
    return None


def _pipeline_problems(cfg: RunConfig, layout: Layout) -> Problems:
    """Pipeline micro-batches that fit the stages and the loop's micro-batch; whole micro-batches to evaluate; a
    block per stage of the built-in GPT."""
    t, n = cfg.train, cfg.parallel.microbatches(layout.pp)
    problem = schedule_problem(cfg.parallel.pp_schedule, cfg.parallel.pp_stages_per_rank, layout.pp, n)
    if problem:
        return [problem]
    if cfg.parallel.compile and cfg.parallel.pp_schedule in SPLIT_BACKWARD:
        kind = cfg.parallel.pp_schedule
        return [("parallel.compile", f"parallel.pp_schedule={kind} splits each backward into its input and weight "
                 "gradients, which a compiled block's backward cannot (set compile: false)")]  # fmt: skip
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
    stages = layout.pp * cfg.parallel.pp_stages_per_rank
    if cfg.recipe == BUILTIN_RECIPE and stages > cfg.model.n_layers:
        key = "parallel.pp_stages_per_rank" if cfg.parallel.pp_stages_per_rank > 1 else "parallel.pp"
        return [(key, f"{stages} stages for model.n_layers={cfg.model.n_layers}: each stage needs a block")]
    return []


def _placement_problems(cfg: RunConfig, layout: Layout, where: str) -> Problems:
    """Offload and loss parallelism need the layout dimension they work on."""
    p = cfg.parallel
    if p.offload and layout.fsdp == 1:
        return [("parallel.offload", f"{where}host offload moves FSDP2's shards, and the {layout.kind} layout "
                 f"({layout.describe()}) shards nothing: set parallel.dp_shard > 1")]  # fmt: skip
    if cfg.train.precision == "float8" and layout.tp > 1:
        return [("train.precision", f"{where}float8 under tensor parallelism needs torchao's float8 parallel styles "
                 "in the recipe's tp_plan, not built yet: use bf16 with parallel.tp > 1")]  # fmt: skip
    if p.loss_parallel and layout.tp == 1:
        return [("parallel.loss_parallel", f"{where}the logits are split over a tensor-parallel group, and the "
                 f"{layout.kind} layout ({layout.describe()}) has none: set parallel.tp > 1")]  # fmt: skip
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


def _context_parallel_problems(cfg: RunConfig, layout: Layout, where: str) -> Problems:
    """What torch's causal ring attention takes, on the resolved layout (a -1 degree included): no pipeline stages
    beside it, whole sequences of equal length, and for the built-in GPT no document mask, no attention dropout and
    a sequence of 2 cp equal chunks (each rank holds a head and a tail chunk)."""
    if layout.cp == 1:
        return []
    if layout.pp > 1:
        return [("parallel.cp", f"{where}context parallelism beside pipeline stages ({layout.describe()}) is not "
                 "built yet")]  # fmt: skip
    if cfg.data.bucket_by_length:
        return [("parallel.cp", f"{where}data.bucket_by_length makes batches of other lengths, and context "
                 "parallelism splits every sequence into 2 x cp equal chunks (set one of them off)")]  # fmt: skip
    if cfg.recipe != BUILTIN_RECIPE:
        return []
    m = cfg.model
    if m.doc_mask:
        return [("parallel.cp", "context parallelism runs torch's causal ring attention, which takes no mask: "
                 "model.doc_mask's attention inside each document is not available with it (set one of them "
                 "off)")]  # fmt: skip
    if m.dropout > 0:
        return [("parallel.cp", f"torch's ring attention takes no attention dropout, and model.dropout={m.dropout} "
                 "asks for it: set model.dropout: 0 with context parallelism")]  # fmt: skip
    if m.seq_len % (2 * layout.cp):
        return [("parallel.cp", f"{where}model.seq_len={m.seq_len} is not a multiple of 2 x cp = {2 * layout.cp}: "
                 "context parallelism cuts each sequence into 2 cp equal chunks, two to a rank")]  # fmt: skip
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
