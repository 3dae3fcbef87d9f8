"""The optimisation loop: steps, batch sizes, AdamW and its schedule, evaluation, precision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runconfig.schema.fields import Problems, Range, Section, doc


@dataclass(frozen=True, kw_only=True)
class TrainConfig(Section):
    steps: int = doc("Optimizer steps to train for.", 200, bounds=Range(ge=1))
    global_batch_size: int = doc("Sequences per optimizer step over all ranks.", 32, bounds=Range(ge=1))
    micro_batch_size: int = doc(
        "Sequences per rank per forward pass; gradient accumulation = global / (micro x data-parallel ranks).",
        4,
        bounds=Range(ge=1),
    )
    lr: float = doc("Peak learning rate (AdamW).", 3e-3, bounds=Range(gt=0))
    min_lr: float = doc("Learning rate at the end of the cosine decay.", 3e-4)
    warmup_steps: int = doc("Linear warmup steps before the cosine decay.", 20, bounds=Range(ge=0))
    weight_decay: float = doc(
        "AdamW decoupled weight decay (matrices only; not norms or biases).", 0.1, bounds=Range(ge=0)
    )
    beta1: float = doc("AdamW beta1.", 0.9, bounds=Range(ge=0, lt=1))
    beta2: float = doc("AdamW beta2.", 0.95, bounds=Range(ge=0, lt=1))
    grad_clip: float = doc("Clip the global gradient norm to this value; 0 disables clipping.", 1.0, bounds=Range(ge=0))
    spike_factor: float = doc(
        "A step whose loss (the mean over ranks) exceeds this factor times the median loss of the launch's last "
        "train.spike_window steps is a loss spike, handled by train.spike_action; 0 = off. The spike's step is "
        "never checkpointed.",
        0.0,
        bounds=Range(ge=0),
    )
    spike_grad_factor: float = doc(
        "A step whose gradient norm (the global norm before clipping, the same on every rank) exceeds this factor "
        "times the median norm of the launch's last train.spike_window steps is a spike too, handled like a loss "
        "spike by train.spike_action; 0 = off.",
        0.0,
        bounds=Range(ge=0),
    )
    spike_window: int = doc(
        "The recent steps a spike (loss or gradient norm) is judged against (at least 8 of them seen in the launch "
        "first).",
        50,
        bounds=Range(ge=8),
    )
    spike_action: Literal["rollback", "stop"] = doc(
        "rollback: the launch ends, the run restarts from the newest checkpoint (which predates the spike) and "
        "skips the data from that checkpoint through the spike's batch (PaLM's remedy; the steps are trained on "
        "the batches after it; a spike event and RUN_DIR/data_skips.json record it; needs job.max_failures >= 1 "
        "for an in-job restart). stop: the run stops with an error naming the step, the newest checkpoint intact.",
        "rollback",
    )
    optimizer_impl: Literal["fused", "foreach", "for-loop"] = doc(
        "AdamW's kernels (torchtitan's optimizer.implementation). fused: one kernel per parameter for the whole "
        "update, on CPU and CUDA (the fastest on CPU: docs/measurements/overhead.md). foreach: "
        "multi-tensor kernels. for-loop: one op at a time per parameter (torch's CPU default, nanoGPT's path on "
        "CPU). All three are deterministic and resume bit-exact; their last bits differ. fused on CPU rounds an "
        "element by where it falls in the tensor (vector body or scalar tail), so a layout that shards parameters "
        "differently (FSDP2, TP) ends within float tolerance of DDP, as every cross-layout run does; foreach and "
        "for-loop round each element alike wherever it lies. A resume runs the kernels its config names, whatever the "
        "checkpoint was saved with (torch's load would take the saved ones; logged where they differ).",
        "fused",
    )
    seed: int = doc("Seed of model initialisation and dropout.", 0)
    eval_every: int = doc("Held-out eval loss every N steps (and at the end); 0 disables it.", 50, bounds=Range(ge=0))
    eval_sequences: int = doc("Held-out sequences per evaluation, split over the ranks.", 64, bounds=Range(ge=1))
    log_every: int = doc("Write a metrics.jsonl line every N steps.", 1, bounds=Range(ge=1))
    precision: Literal["auto", "fp32", "bf16", "float8"] = doc(
        "auto = bf16 autocast on GPU, fp32 on CPU. float8: bf16, and the linear layers' matrix products in float8 "
        "with dynamic per-tensor scales (torchao's Float8Linear, as torchtitan's float8 training; the weights and "
        "optimizer state stay fp32, checkpoints unchanged): GPUs of compute capability 8.9 or newer (H100, L40S), "
        "the recipe's output_layer and layers whose sizes are not multiples of 16 kept in bf16.",
        "auto",
    )
    float8_emulate: bool = doc(
        "With precision float8: emulate the float8 matrix products (the same rounding, computed in fp32) so float8 "
        "runs on CPU and older GPUs, for tests; no speed-up.",
        False,
    )
    device: Literal["auto", "cpu", "cuda"] = doc("auto = CUDA when available, else CPU.", "auto")
    host_mmap_threshold_kb: int = doc(
        "Fix glibc's mmap threshold (mallopt M_MMAP_THRESHOLD) at this many KiB: host tensors this large get their "
        "own mapping, given back to the OS when freed. 0 = glibc's dynamic default (fastest; freed buffers stay "
        "resident). A fixed threshold lowers FSDP's peak memory on CPU and slows it (docs/measurements/parallel.md).",
        0,
        bounds=Range(ge=0),
    )

    def bf16_on(self, device_type: str) -> bool:
        """Whether compute runs in bf16 on this device type (precision auto: on CUDA)."""
        return self.precision in ("bf16", "float8") or (self.precision == "auto" and device_type == "cuda")

    def relations(self) -> Problems:
        if self.float8_emulate and self.precision != "float8":
            return [("float8_emulate", f"emulates float8 matrix products, and precision is {self.precision}")]
        if not 0 <= self.min_lr <= self.lr:
            return [("min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}")]
        return []
