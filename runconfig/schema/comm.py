"""Gradient communication of the DDP layouts: the all-reduce algorithm, overlap, buckets, the backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runconfig.schema.fields import Problems, Range, Section, doc


@dataclass(frozen=True, kw_only=True)
class CommConfig(Section):
    allreduce: Literal["auto", "flat", "hierarchical", "leader", "two_level"] = doc(
        "Gradient all-reduce of DDP layouts across nodes. auto: measure flat and the hierarchical variants on the "
        "run's own process groups at start-up for the model's bucket sizes, "
        "log the table, use the fastest per bucket size where it beats flat clearly (5% and in every round of 2-5; "
        "flat when unsure; the candidates include the hierarchical one pipelined over 1 MiB chunks), "
        "and record the choice in summary.json and the checkpoints "
        "(a resume reuses it: same reduction order, bit-exact); with every rank on one host in one network "
        "namespace (simulated nodes: every link is loopback) it chooses flat for every bucket without measuring "
        "(flat won in training there, whatever the other algorithms' timings alone); a plan with flat for every "
        "bucket runs DDP's own all-reduce (no hook: the same bits as flat). flat: DDP's own all-reduce over all ranks. "
        "hierarchical: intra-node reduce-scatter, inter-node all-reduce of the shard, intra-node all-gather (each "
        "rank's NIC carries 1/ranks_per_node of the data). leader: reduce to each node's first rank, all-reduce "
        "among those, broadcast inside the node. two_level: all-reduce inside the node, then across nodes. All but "
        "flat need more than one node and more than one rank per node; otherwise flat is used.",
        "auto",
    )
    plan_from: str | None = doc(
        "comm.allreduce=auto: use the plan measured by an earlier run (its run directory, or its "
        "allreduce_plan.json) instead of measuring: the same algorithm per bucket size, so two runs are bit-identical "
        "(on CPU) as with a fixed algorithm. Its topology and comm settings must match this run's.",
        None,
    )
    overlap: bool = doc(
        "Run the trainer's all-reduce algorithms bucket by bucket while backward goes on: on a thread of its own "
        "(CPU), on a CUDA stream of its own (GPU); false: synchronously inside DDP's hook, blocking backward. The "
        "results are bit-identical: checked before step 1 on every bucket size (the run ends, naming the ranks, "
        "where they are not).",
        True,
    )
    compress: Literal["none", "bf16"] = doc(
        "bf16: gradients cross the slow link in bfloat16 (half the bytes): the inter-node phase of the "
        "hierarchical all-reduce (intra-node phases stay fp32), or the whole all-reduce where it is flat (torch's "
        "bf16_compress_hook). Changes results within bf16 rounding of the summed gradients; DDP layouts only.",
        "none",
    )
    chunk_kb: float = doc(
        "Hierarchical all-reduce: a bucket larger than this goes through the three phases in chunks of this size, "
        "pipelined (a chunk crosses the inter-node link while the next is reduced inside the node); 0 = whole "
        "buckets. Wins on a slow inter-node link, loses where the link is as fast as the node (one host): see "
        "docs/measurements/allreduce.md.",
        0.0,
        bounds=Range(ge=0, text=">= 0 (0: whole buckets)"),
    )
    bucket_mb: float = doc("DDP gradient bucket size in MB.", 25.0, bounds=Range(gt=0))
    first_bucket_mb: float = doc(
        "Size cap in MB of DDP's first gradient bucket: the gradients backward produces first (the last layers'), "
        "reduced while backward goes on; the buckets after it are bucket_mb. 1 is DDP's own default (which DDP "
        "applies only when no bucket size is given at all); >= bucket_mb: the first bucket as large as the rest.",
        1.0,
        bounds=Range(gt=0),
    )
    defer_agreement: bool = doc(
        "The per-step agreement of the ranks (the step's loss, a stop request, the time-based checkpoint trigger) "
        "runs while the next step computes and is acted on at the next step boundary (a stop one step later, all "
        "ranks at the same step); a boundary that saves or ends training still agrees on its own step at once. "
        "false: every step waits for it (one small all-reduce's latency per step).",
        True,
    )
    carry_agreement: bool = doc(
        "DDP layouts over gloo (CPU): the per-step agreement rides in the step's gradient reduction, as the gradient "
        "of a 3-element parameter that only DDP sees (not the model's: no optimizer, clipping, norm or checkpoint "
        "sees it), so it needs no collective of its own and each step is acted on at its own boundary. Elsewhere "
        "(FSDP2, tensor or pipeline parallelism, NCCL, comm.compress=bf16) the separate all-reduce of "
        "defer_agreement runs. The parameters are the same either way; the recorded loss, a float32 mean instead of "
        "a float64 one, may differ in its last bits.",
        True,
    )
    sync: Literal["ddp", "diloco", "local_sgd"] = doc(
        "How the nodes' replicas agree. ddp: every step's gradients averaged over all ranks. diloco (DiLoCo): DDP "
        "inside each node only; every comm.sync_every steps the nodes average their pseudo-gradient (the parameters "
        "at the last sync minus now) and an outer SGD optimizer (comm.outer_lr, outer_momentum, Nesterov) applies "
        "it to the parameters of the last sync. local_sgd: the same rounds, the nodes' parameters averaged. With "
        "either, checkpoints (and a stop's, a time-based one's) wait for the round's end, where every replica holds "
        "the same parameters (with comm.sync_fragments above 1, only the last meetings are); a resume needs the "
        "same number of nodes (each keeps its own optimizer state). DDP layouts only.",
        "ddp",
    )
    sync_every: int = doc(
        "comm.sync=diloco or local_sgd: optimizer steps per round (H); checkpoint.every_steps and "
        "memory_every_steps must be multiples of it.",
        50,
        bounds=Range(ge=1),
    )
    sync_fragments: int = doc(
        "comm.sync=diloco or local_sgd: streaming (Streaming DiLoCo, Douillard et al., 2025) when above 1. The "
        "parameters are cut into this many fragments (whole tensors in the model's order, of near-equal size; at "
        "most one per trained tensor), and "
        "fragment p meets every comm.sync_every steps at an offset of (p + 1) x comm.sync_every / sync_fragments "
        "steps, so each meeting carries one fragment and the link's peak load is a fragment's, not the model's; "
        "the last fragment meets at the round's end, every fragment at the last step. A checkpoint at a round's "
        "end holds the fragments' last meetings as the model and each node's own parameters beside them. "
        "comm.sync_every must be a multiple of it.",
        1,
        bounds=Range(ge=1),
    )
    outer_lr: float = doc("comm.sync=diloco: the outer SGD's learning rate.", 0.7, bounds=Range(gt=0))
    outer_momentum: float = doc("comm.sync=diloco: the outer SGD's momentum.", 0.9, bounds=Range(ge=0, lt=1))
    outer_nesterov: bool = doc("comm.sync=diloco: Nesterov momentum for the outer SGD (with outer_momentum > 0).", True)
    backend: Literal["auto", "gloo", "nccl"] = doc("auto = NCCL on CUDA, gloo on CPU.", "auto")
    timeout_s: float = doc(
        "Timeout of process-group set-up and of every collective, seconds.", 300.0, bounds=Range(gt=0)
    )
    master_addr: str | None = doc(
        "Address the ranks rendezvous at. Unset: 127.0.0.1 when all ranks share a host, else rank 0's host name.",
        None,
    )

    def relations(self) -> Problems:
        if self.plan_from and self.allreduce != "auto":
            return [("plan_from", f"applies to comm.allreduce=auto only (this config has {self.allreduce!r})")]
        return []
