"""How the model is split over the ranks; the rules of a layout are runconfig/layout.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runconfig.layout import DIMS, degree_problem
from runconfig.schema.fields import Problems, Range, Section, doc


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(Section):
    dp_replicate: int = doc(
        "Data-parallel replicas: whole copies of the (sharded) model, gradients all-reduced between them (DDP; with "
        "dp_shard > 1, HSDP's replicate dimension, across nodes). -1 = what the other degrees leave.",
        -1,
    )
    dp_shard: int = doc(
        "FSDP2 shard degree: parameters, gradients and optimizer state split over this many ranks (inside a node "
        "when it equals job.ranks_per_node: HSDP). 1 = no sharding; -1 = what the other degrees leave.",
        1,
    )
    tp: int = doc(
        "Tensor-parallel degree, innermost, inside a node: each layer's matrices split over this many ranks with the "
        "recipe's tp_plan (the built-in GPT: heads and MLP units, sequence parallelism on the norms). 1 = off.",
        1,
    )
    cp: int = doc(
        "Context-parallel degree: each sequence split over this many ranks for attention (torch's context-parallel "
        "ring attention; each rank holds two of 2 cp chunks, head and tail, for causal balance), between dp_shard "
        "and tp. They read the same batch, and FSDP2 shards the parameters over dp_shard x cp. Needs a recipe with "
        "Recipe.context_parallel (the built-in GPT has one), a sequence length divisible by 2 cp, and causal "
        "attention through F.scaled_dot_product_attention (not model.doc_mask). 1 = off.",
        1,
    )
    pp: int = doc(
        "Pipeline-parallel stages, outermost (across nodes): the model cut into pp consecutive parts at the recipe's "
        "split points (the built-in GPT: between blocks), one per group of ranks. 1 = off.",
        1,
    )
    pp_schedule: Literal["1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"] = (
        doc(
            "Pipeline schedule (torch.distributed.pipelining's): 1F1B (one forward, one backward: at most pp "
            "micro-batches' activations held) or GPipe (all forwards, then all backwards), one stage per rank; "
            "Interleaved1F1B and InterleavedZeroBubble (backward split into input and weight gradients), "
            "parallel.pp_stages_per_rank stages per rank placed in a loop (rank r holds stages r, r + pp, ...); "
            "ZBVZeroBubble and DualPipeV, two stages per rank placed in a V (rank r holds r and 2 pp - 1 - r).",
            "1F1B",
        )
    )
    pp_stages_per_rank: int = doc(
        "Pipeline stages each rank holds (virtual stages): the model is cut into pp x this many stages. 1 for 1F1B "
        "and GPipe, 2 or more for the interleaved schedules, 2 for ZBVZeroBubble and DualPipeV.",
        1,
        bounds=Range(ge=1, le=64),
    )
    pp_microbatches: int = doc(
        "Pipeline micro-batches each train.micro_batch_size batch is cut into (at least pp, dividing it); 0 = pp.",
        0,
        bounds=Range(ge=0, text=">= 0 (0 = pp)"),
    )
    offload: bool = doc(
        "FSDP2 keeps each rank's shard of the parameters, gradients and optimizer state in host memory (pinned on "
        "GPUs) and the optimizer steps on the CPU; each block's parameters come to the device for its forward and "
        "backward (FSDP2's CPUOffloadPolicy, DeepSpeed's ZeRO-Offload). Less device memory, a slower step. Needs "
        "sharding: parallel.dp_shard > 1.",
        False,
    )
    loss_parallel: bool = doc(
        "Under tensor parallelism, the logits stay split by vocabulary over the tp group and the loss (torch's "
        "cross-entropy) is computed on the pieces, instead of gathering the whole logits on every rank "
        "(torch.distributed.tensor.parallel.loss_parallel). Needs parallel.tp > 1, a recipe that names its "
        "Recipe.output_layer, and a loss of F.cross_entropy on class indices (no label_smoothing).",
        False,
    )
    fsdp_reshard_after_forward: bool = doc(
        "FSDP: free each block's gathered parameters after its forward and gather them again for backward (less "
        "memory, more communication); the last block always keeps them.",
        True,
    )
    activation_checkpointing: Literal["none", "selective", "op", "full"] = doc(
        "Recompute activations in backward instead of keeping them: full = every block, selective = every other "
        "block, op = in every block all but the matrix products' and attention's outputs (per-op); none = keep all. "
        "Blocks as for FSDP (the recipe's fsdp_wrap, else the largest ModuleList's children).",
        "none",
    )
    compile: bool = doc(
        "torch.compile each of the model's blocks (as for FSDP; the whole model where it has none), in place: "
        "parameter names and checkpoints are unchanged. The first step pays the compilation.",
        False,
    )
    meta_init: bool = doc(
        "Build the model's parameters on the meta device and allocate only each rank's part after the split, so no "
        "rank ever holds the whole model (models larger than a rank's memory). Initial values then come module by "
        "module from train.seed and the module's path (the recipe's init_weights, else reset_parameters()): the "
        "same in every layout, not those of the default build.",
        False,
    )

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIMS}

    def microbatches(self, pp: int) -> int:
        """Pipeline micro-batches per loop micro-batch at ``pp`` stages."""
        return self.pp_microbatches or pp

    def relations(self) -> Problems:
        return [(name, problem) for name in DIMS if (problem := degree_problem(getattr(self, name)))]
