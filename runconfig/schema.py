"""The typed run configuration: one keyword-only dataclass per concern.

Every field is documented where it is declared (``doc=`` metadata); the loader in
``runconfig.load`` checks types from the annotations and calls each section's ``check``
for ranges, so a config object that exists is a valid one. Torch-free: the login-node
side (``hpc``) and the trainer both import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from runconfig.layout import Layout, LayoutError, resolve

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# What may reach an #SBATCH line unquoted: no spaces, quotes, '$', backticks, ';' or newlines.
SLURM_NAMES_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64})*$")
CONSTRAINT_RE = re.compile(r"^[A-Za-z0-9_.&|,\[\]*:!()-]{1,256}$")
MEM_RE = re.compile(r"^[0-9]+[KMGT]?$")
TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{2}))?(?::(\d{2}))?$")
OPTION_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
OPTION_VALUE_RE = re.compile(r"^[A-Za-z0-9_.,:/=+@%-]{0,256}$")
SRUN_ARG_RE = re.compile(r"^--?[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.,:/=+@%-]*)?$")
#: The built-in recipe's name; any other recipe is "module.path:function".
BUILTIN_RECIPE = "gpt"
RECIPE_RE = re.compile(r"^(gpt|[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*)$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def slurm_minutes(text: str) -> int | None:
    """Minutes in a Slurm time limit, read as Slurm reads it: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
    (seconds round up); None if bad. Two fields without days are minutes:seconds (``25:00`` is 25 minutes)."""
    m = TIME_RE.match(text)
    if not m:
        return None
    days, first, second, third = m.groups()
    if days is None and third is None and second is None:
        return int(first)  # plain minutes
    if days is None and third is None:
        seconds = int(second)
        return None if seconds > 59 else int(first) + (1 if seconds else 0)
    hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
    if minutes > 59 or seconds > 59:
        return None
    return int(days or 0) * 1440 + hours * 60 + minutes + (1 if seconds else 0)


def _line_problem(text: str) -> str | None:
    if any(c in text for c in "\n\r\0"):
        return "must be a single line"
    return None


def doc(text: str, default=None, factory=None):
    """A dataclass field with its documentation attached."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


Problems = list[tuple[str, str]]  # (key, what is wrong)
SIGNAL_NAMES = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP", "SIGCONT", "SIGXCPU")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    name: str = doc("Run name: letters, digits, '.', '_', '-' (at most 64); names the run directory.", "run")
    nodes: int = doc("Number of nodes. Locally they are simulated on one host.", 1)
    ranks_per_node: int = doc("Processes (ranks) per node; one per GPU on GPU nodes.", 1)
    threads_per_rank: int = doc("torch intra-op threads per rank; 0 = cores on the host / local ranks.", 0)
    # Slurm: each of these maps onto the generated sbatch script (hpc/slurm.py); unset ones are left out.
    gpus_per_node: int = doc("GPUs per node (--gpus-per-node); usually = ranks_per_node on GPU nodes.", 0)
    cpus_per_task: int = doc("CPUs per rank (--cpus-per-task).", 1)
    mem: str | None = doc("Memory per node (--mem), e.g. 64G; unset = the partition's default.", None)
    partition: str | None = doc("Slurm partition(s), comma-separated; unset = the cluster's default.", None)
    account: str | None = doc("Slurm account to charge.", None)
    qos: str | None = doc("Slurm quality of service.", None)
    time: str = doc("Wall-time limit of one job, as Slurm reads it: MM, MM:SS, HH:MM:SS or D-HH:MM:SS.", "01:00:00")
    constraint: str | None = doc("Node features (--constraint), e.g. 'ib&a100'.", None)
    exclusive: bool = doc("Whole nodes only (--exclusive).", False)
    signal: str = doc(
        "Signal Slurm sends before the time limit (and on preemption); must be one of checkpoint.stop_signals.",
        "SIGUSR2",
    )
    signal_lead_s: int = doc("Seconds before the time limit at which the signal is sent.", 120)
    setup: list[str] = doc(
        "Shell lines run before the ranks start (module loads, sourcing an environment). Each line is split "
        "into words and re-quoted: no expansion, substitution or chaining of config values.",
        factory=list,
    )
    env: dict[str, str] = doc("Environment variables exported to every rank (values are quoted).", factory=dict)
    mpi: Literal["auto", "pmi2", "pmix", "none"] = doc(
        "srun's MPI plugin: auto = pmi2 for MPICH, pmix for Open MPI (the wrong pairing starts N worlds of 1).",
        "auto",
    )
    srun_args: list[str] = doc("Extra srun options, e.g. ['--cpu-bind=cores'].", factory=list)
    launch_prefix: list[str] = doc(
        "Words put before `python -m trainer` on each rank, e.g. [apptainer, exec, --nv, image.sif]; each word is "
        "passed as is (letters, digits and _ . , : / = + @ % - only: no spaces, quotes or shell characters). A "
        "wrapper must let the stop signal reach the rank: check it with `python -m hpc selftest CONFIG`.",
        factory=list,
    )
    sbatch_extra: dict[str, str] = doc("Extra sbatch options, e.g. {reservation: big}.", factory=dict)
    max_restarts: int = doc("Requeues after a stop (time limit, preemption) before giving up.", 20)
    max_failures: int = doc(
        "In-job restarts per run after a launch fails through no fault of the input (a rank killed or crashed, a "
        "collective failed, a hang): the ranks restart in the same allocation from the newest valid checkpoint. "
        "Bad input (exit status 2) is never retried; 0 turns restarts off.",
        3,
    )
    min_nodes: int | None = doc(
        "Fewest nodes the run may continue on: after a failure that names a node (left out from then on), the ranks "
        "restart in the same allocation on the nodes left when they are at least this many (the world shrinks; "
        "the global batch and the sample order stay, through more gradient accumulation). Fewer left: a Slurm run "
        "continues in a new job that excludes the bad nodes. Unset: job.nodes (never shrink).",
        None,
    )
    exclude_bad_nodes: bool = doc(
        "Leave out of every later launch of the run the node a failure points at (the rank that went away or hung "
        "first, a node the preflight found unfit), recorded with the evidence in history.jsonl.",
        True,
    )
    restart_backoff_s: float = doc(
        "Seconds before the first in-job restart of a run; each further restart waits twice as long (at most 300).",
        5.0,
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def min_nodes_or_all(self) -> int:
        return self.nodes if self.min_nodes is None else self.min_nodes

    @property
    def time_minutes(self) -> int:
        minutes = slurm_minutes(self.time)
        assert minutes is not None, "validated in check()"
        return minutes

    def check(self) -> Problems:
        out: Problems = []
        if not NAME_RE.match(self.name):
            out.append(("name", f"{self.name!r} must match {NAME_RE.pattern}"))
        if self.nodes < 1:
            out.append(("nodes", f"must be >= 1, got {self.nodes}"))
        if self.ranks_per_node < 1:
            out.append(("ranks_per_node", f"must be >= 1, got {self.ranks_per_node}"))
        if self.threads_per_rank < 0:
            out.append(("threads_per_rank", f"must be >= 0, got {self.threads_per_rank}"))
        if not 0 <= self.restart_backoff_s <= 3600:
            out.append(("restart_backoff_s", f"must be between 0 and 3600 seconds, got {self.restart_backoff_s}"))
        for key in ("gpus_per_node", "max_restarts", "max_failures"):
            if getattr(self, key) < 0:
                out.append((key, f"must be >= 0, got {getattr(self, key)}"))
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            out.append(("min_nodes", f"must be between 1 and job.nodes={self.nodes}, got {self.min_nodes}"))
        elif self.min_nodes is not None and self.min_nodes < self.nodes and self.max_failures == 0:
            out.append(("min_nodes", "continuing on fewer nodes needs in-job restarts: job.max_failures is 0"))
        if self.cpus_per_task < 1:
            out.append(("cpus_per_task", f"must be >= 1, got {self.cpus_per_task}"))
        for key in ("partition", "account", "qos"):
            value = getattr(self, key)
            if value is not None and not SLURM_NAMES_RE.match(value):
                out.append((key, f"{value!r} must be names of letters, digits, '_', '.', '-' (comma-separated)"))
        if self.constraint is not None and not CONSTRAINT_RE.match(self.constraint):
            out.append(("constraint", f"{self.constraint!r} may hold only feature names and & | , [ ] * : ! ( )"))
        if self.mem is not None and not MEM_RE.match(self.mem):
            out.append(("mem", f"{self.mem!r} must look like 64G, 512M or 1000"))
        minutes = slurm_minutes(self.time)
        if minutes is None or minutes < 1:
            out.append(
                (
                    "time",
                    f"{self.time!r} must be MM, MM:SS, HH:MM:SS or D-HH:MM:SS (as Slurm reads it), at least a minute",
                )
            )
        if self.signal not in SIGNAL_NAMES:
            out.append(("signal", f"{self.signal!r} is not one of {', '.join(SIGNAL_NAMES)}"))
        if self.signal_lead_s < 10:
            out.append(("signal_lead_s", f"must be >= 10, got {self.signal_lead_s}"))
        elif minutes and self.signal_lead_s >= minutes * 60:
            out.append(("signal_lead_s", f"{self.signal_lead_s} s is not shorter than the time limit {self.time}"))
        for i, line in enumerate(self.setup):
            problem = _line_problem(line)
            if problem:
                out.append((f"setup[{i}]", f"{line!r} {problem}"))
        for name, value in self.env.items():
            if not ENV_NAME_RE.match(name):
                out.append((f"env.{name}", "is not a valid environment variable name"))
            elif _line_problem(value):
                out.append((f"env.{name}", f"{value!r} must be a single line"))
        for i, arg in enumerate(self.srun_args):
            if not SRUN_ARG_RE.match(arg):
                out.append(
                    (
                        f"srun_args[{i}]",
                        f"{arg!r} must look like --option or --option=value (no spaces, quotes or shell characters)",
                    )
                )
        for i, word in enumerate(self.launch_prefix):
            if not word or not OPTION_VALUE_RE.match(word):
                out.append(
                    (
                        f"launch_prefix[{i}]",
                        f"{word!r} may hold only letters, digits and _ . , : / = + @ % - (one word: no spaces, quotes "
                        "or shell characters)",
                    )
                )
        for key, value in self.sbatch_extra.items():
            if not OPTION_KEY_RE.match(key):
                out.append((f"sbatch_extra.{key}", "is not a valid sbatch option name"))
            elif not OPTION_VALUE_RE.match(value):
                out.append((f"sbatch_extra.{key}", f"{value!r} may hold only letters, digits and _ . , : / = + @ % -"))
        return out


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The built-in GPT's shape: the arguments of ``recipe: gpt``. Another recipe takes its own from recipe_args."""

    vocab_size: int = doc("Vocabulary size; must cover the dataset's tokenizer (byte-level: 257).", 257)
    seq_len: int = doc("Context length in tokens of each training sequence.", 128)
    d_model: int = doc("Width of the residual stream.", 128)
    n_layers: int = doc("Number of transformer blocks.", 2)
    n_heads: int = doc("Attention heads; must divide d_model.", 4)
    mlp_ratio: int = doc("Hidden width of the MLP as a multiple of d_model.", 4)
    dropout: float = doc("Dropout probability (0 disables dropout).", 0.0)

    def check(self) -> Problems:
        out: Problems = []
        for key in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, key) < 1:
                out.append((key, f"must be >= 1, got {getattr(self, key)}"))
        if self.n_heads >= 1 and self.d_model % self.n_heads:
            out.append(("n_heads", f"{self.n_heads} does not divide d_model={self.d_model}"))
        if not 0.0 <= self.dropout < 1.0:
            out.append(("dropout", f"must be in [0, 1), got {self.dropout}"))
        return out


#: Smallest shard of a prepared dataset (data.shard_tokens, and `python -m trainer.data prepare`).
MIN_SHARD_TOKENS = 1024


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = doc(
        "Folder of text files to prepare on first use, or 'stdlib' for this Python's standard library.",
        "stdlib",
    )
    include: list[str] = doc("Glob patterns (relative to source) of the files to take.", factory=lambda: ["*.py"])
    max_source_bytes: int = doc("Stop reading the source after this many bytes; 0 = no limit.", 0)
    path: str | None = doc(
        "Prepared dataset folder (manifest.json + HDF5 shards). Unset: a cache folder derived from the "
        "source under $HPC_DATA_CACHE (default ~/.cache/hpc-trainer/data).",
        None,
    )
    val_fraction: float = doc("Fraction of source files held out for the eval loss.", 0.05)
    shard_tokens: int = doc("Tokens per HDF5 shard when preparing.", 4_000_000)
    seed: int = doc("Seed of the global sample order (with the epoch).", 1234)
    verify: str = doc(
        "Start-up check of the prepared shards against manifest.json: 'checksum' = each shard's SHA-256 (every "
        "byte read once, the shards split over the ranks); 'size' = only each shard's token count and dtype, for "
        "datasets too large to read at every start, and then every window read while training is range-checked. "
        "Both refuse a vocabulary larger than model.vocab_size.",
        "checksum",
    )

    tokenizer: str | None = doc(
        "A tokenizers-package tokenizer.json used when preparing data.source on first use (its ids are stored in the "
        "same HDF5 shards; the vocabulary size comes from it). Unset: bytes (vocabulary 257).",
        None,
    )
    prefetch: int = doc(
        "Micro-batches fetched and collated ahead of the step by as many background threads (hides a dataset slower "
        "than a step when its items can be fetched in parallel, e.g. file reads); 0 = fetch in the training thread.",
        2,
    )
    read_retries: int = doc(
        "Further attempts at reading a token window that failed with a transient storage error (EIO, ESTALE, "
        "ETIMEDOUT, ...: a network file system's fail-over), the shard reopened each time; then the launch fails "
        "as a crash and is restarted (job.max_failures). Other errors are not retried; 0 = no retries.",
        5,
    )
    read_retry_backoff_s: float = doc(
        "Seconds before the first retry of a data read; each next one waits twice as long (at most 30 s, with "
        "jitter), and no retry starts later than 120 s after the first attempt.",
        0.5,
    )

    def check(self) -> Problems:
        out: Problems = []
        if self.prefetch < 0:
            out.append(("prefetch", f"must be >= 0, got {self.prefetch}"))
        if self.read_retries < 0:
            out.append(("read_retries", f"must be >= 0, got {self.read_retries}"))
        if not 0 < self.read_retry_backoff_s <= 60:
            out.append(("read_retry_backoff_s", f"must be in (0, 60] seconds, got {self.read_retry_backoff_s}"))
        if self.verify not in ("checksum", "size"):
            out.append(("verify", f"must be 'checksum' or 'size', got {self.verify!r}"))
        if not self.source:
            out.append(("source", "must not be empty"))
        if not self.include:
            out.append(("include", "needs at least one pattern"))
        if self.max_source_bytes < 0:
            out.append(("max_source_bytes", f"must be >= 0, got {self.max_source_bytes}"))
        if not 0.0 < self.val_fraction < 1.0:
            out.append(("val_fraction", f"must be in (0, 1), got {self.val_fraction}"))
        if self.shard_tokens < MIN_SHARD_TOKENS:
            out.append(("shard_tokens", f"must be >= {MIN_SHARD_TOKENS}, got {self.shard_tokens}"))
        return out


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = doc("Optimizer steps to train for.", 200)
    global_batch_size: int = doc("Sequences per optimizer step over all ranks.", 32)
    micro_batch_size: int = doc(
        "Sequences per rank per forward pass; gradient accumulation = global / (micro x data-parallel ranks).", 4
    )
    lr: float = doc("Peak learning rate (AdamW).", 3e-3)
    min_lr: float = doc("Learning rate at the end of the cosine decay.", 3e-4)
    warmup_steps: int = doc("Linear warmup steps before the cosine decay.", 20)
    weight_decay: float = doc("AdamW decoupled weight decay (matrices only; not norms or biases).", 0.1)
    beta1: float = doc("AdamW beta1.", 0.9)
    beta2: float = doc("AdamW beta2.", 0.95)
    grad_clip: float = doc("Clip the global gradient norm to this value; 0 disables clipping.", 1.0)
    optimizer_impl: Literal["fused", "foreach", "for-loop"] = doc(
        "AdamW's kernels (torchtitan's optimizer.implementation). fused: one kernel per parameter for the whole "
        "update, on CPU and CUDA (CPU: 0.9 against 3.1 ms a step for the tiny model's 52 tensors). foreach: "
        "multi-tensor kernels. for-loop: one op at a time per parameter (torch's CPU default, nanoGPT's path on "
        "CPU). All three are deterministic and resume bit-exact; their last bits differ. fused on CPU rounds an "
        "element by where it falls in the tensor (vector body or scalar tail), so a layout that shards parameters "
        "differently (FSDP2, TP) ends within float tolerance of DDP, as every cross-layout run does; foreach and "
        "for-loop round each element alike wherever it lies. A resume runs the kernels its config names, whatever the "
        "checkpoint was saved with (torch's load would take the saved ones; logged where they differ).",
        "fused",
    )
    seed: int = doc("Seed of model initialisation and dropout.", 0)
    eval_every: int = doc("Held-out eval loss every N steps (and at the end); 0 disables it.", 50)
    eval_sequences: int = doc("Held-out sequences per evaluation, split over the ranks.", 64)
    log_every: int = doc("Write a metrics.jsonl line every N steps.", 1)
    precision: Literal["auto", "fp32", "bf16"] = doc("auto = bf16 autocast on GPU, fp32 on CPU.", "auto")
    device: Literal["auto", "cpu", "cuda"] = doc("auto = CUDA when available, else CPU.", "auto")
    host_mmap_threshold_kb: int = doc(
        "Fix glibc's mmap threshold (mallopt M_MMAP_THRESHOLD) at this many KiB: host tensors this large get their "
        "own mapping, given back to the OS when freed. 0 = glibc's dynamic default (fastest; freed buffers stay "
        "resident). On CPU, 256 cut FSDP's peak memory per rank by 36% and its speed by 34% (bench/README.md).",
        0,
    )

    def bf16_on(self, device_type: str) -> bool:
        """Whether compute runs in bf16 on this device type (precision auto: on CUDA)."""
        return self.precision == "bf16" or (self.precision == "auto" and device_type == "cuda")

    def check(self) -> Problems:
        out: Problems = []
        for key in ("steps", "global_batch_size", "micro_batch_size", "log_every", "eval_sequences"):
            if getattr(self, key) < 1:
                out.append((key, f"must be >= 1, got {getattr(self, key)}"))
        for key in ("warmup_steps", "eval_every", "host_mmap_threshold_kb"):
            if getattr(self, key) < 0:
                out.append((key, f"must be >= 0, got {getattr(self, key)}"))
        if not self.lr > 0:
            out.append(("lr", f"must be > 0, got {self.lr}"))
        if not 0 <= self.min_lr <= self.lr:
            out.append(("min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}"))
        if self.weight_decay < 0:
            out.append(("weight_decay", f"must be >= 0, got {self.weight_decay}"))
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                out.append((key, f"must be in [0, 1), got {getattr(self, key)}"))
        if self.grad_clip < 0:
            out.append(("grad_clip", f"must be >= 0, got {self.grad_clip}"))
        return out


@dataclass(frozen=True, kw_only=True)
class CommConfig:
    allreduce: Literal["auto", "flat", "hierarchical", "leader", "two_level"] = doc(
        "Gradient all-reduce of DDP layouts across nodes. auto: measure flat and the hierarchical variants on the "
        "run's own process groups at start-up for the model's bucket sizes (well under a second on a fast fabric), "
        "log the table, use the fastest per bucket size, and record the choice in summary.json and the checkpoints "
        "(a resume reuses it: same reduction order, bit-exact); with every rank on one host in one network "
        "namespace (simulated nodes: every link is loopback) it measures and records but chooses flat, which won in "
        "training there; a plan with flat for every bucket runs DDP's own all-reduce (no hook: the same bits as "
        "flat). flat: DDP's own all-reduce over all ranks. "
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
        "buckets. Wins on a slow inter-node link (1.48x flat at 4-16 MiB over 200 Mbit/s, against 1.41x whole), "
        "loses where the link is as fast as the node (one host).",
        0.0,
    )
    bucket_mb: float = doc("DDP gradient bucket size in MB.", 25.0)
    first_bucket_mb: float = doc(
        "Size cap in MB of DDP's first gradient bucket: the gradients backward produces first (the last layers'), "
        "reduced while backward goes on; the buckets after it are bucket_mb. 1 is DDP's own default (which DDP "
        "applies only when no bucket size is given at all); >= bucket_mb: the first bucket as large as the rest.",
        1.0,
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
    backend: Literal["auto", "gloo", "nccl"] = doc("auto = NCCL on CUDA, gloo on CPU.", "auto")
    timeout_s: float = doc("Timeout of process-group set-up and of every collective, seconds.", 300.0)
    master_addr: str | None = doc(
        "Address the ranks rendezvous at. Unset: 127.0.0.1 when all ranks share a host, else rank 0's host name.",
        None,
    )

    def check(self) -> Problems:
        out: Problems = []
        if not self.bucket_mb > 0:
            out.append(("bucket_mb", f"must be > 0, got {self.bucket_mb}"))
        if not self.first_bucket_mb > 0:
            out.append(("first_bucket_mb", f"must be > 0, got {self.first_bucket_mb}"))
        if not self.timeout_s > 0:
            out.append(("timeout_s", f"must be > 0, got {self.timeout_s}"))
        if not self.chunk_kb >= 0:
            out.append(("chunk_kb", f"must be >= 0 (0: whole buckets), got {self.chunk_kb}"))
        if self.plan_from and self.allreduce != "auto":
            out.append(("plan_from", f"applies to comm.allreduce=auto only (this config has {self.allreduce!r})"))
        return out


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
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
    pp: int = doc(
        "Pipeline-parallel stages, outermost (across nodes): the model cut into pp consecutive parts at the recipe's "
        "split points (the built-in GPT: between blocks), one per group of ranks. 1 = off.",
        1,
    )
    pp_schedule: Literal["1F1B", "GPipe"] = doc(
        "Pipeline schedule: 1F1B (one forward, one backward: at most pp micro-batches' activations held) or GPipe "
        "(all forwards, then all backwards).",
        "1F1B",
    )
    pp_microbatches: int = doc(
        "Pipeline micro-batches each train.micro_batch_size batch is cut into (at least pp, dividing it); 0 = pp.",
        0,
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
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}

    def check(self) -> Problems:
        out: Problems = []
        for key in ("dp_replicate", "dp_shard", "tp", "pp"):
            value = getattr(self, key)
            if value != -1 and value < 1:
                out.append((key, f"must be >= 1, or -1 for what the other degrees leave; got {value}"))
        if self.pp_microbatches < 0:
            out.append(("pp_microbatches", f"must be >= 0 (0 = pp), got {self.pp_microbatches}"))
        return out

    def microbatches(self, pp: int) -> int:
        """Pipeline micro-batches per loop micro-batch at ``pp`` stages."""
        return self.pp_microbatches or pp


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_steps: int = doc("Commit a checkpoint every N optimizer steps; 0 = not by step count.", 100)
    every_minutes: float = doc("Commit a checkpoint when this many minutes passed since the last; 0 = off.", 0.0)
    keep_last: int = doc("Committed generations kept (>= 2); older ones are pruned after a newer commit.", 2)
    keep_every: int = doc("Also keep forever every checkpoint whose step is a multiple of this; 0 = none.", 0)
    async_save: bool = doc("Copy the state to CPU memory and write it in the background while training goes on.", False)
    at_end: bool = doc("Commit a checkpoint when training completes.", True)
    stop_signals: list[str] = doc(
        "Signals that stop training at the next step boundary with a committed checkpoint (exit status 75: "
        "stopped, resumable). SIGUSR1 is left out by default: NCCL uses it on some systems.",
        factory=lambda: ["SIGUSR2", "SIGTERM"],
    )
    resume: bool = doc("Continue from the newest valid checkpoint in the run directory when there is one.", True)
    allow_shape_change: bool = doc(
        "Resume even if the model or optimizer config changed since the checkpoint (a warm start: parameters "
        "whose name and shape still match are loaded, the others keep their fresh initialisation, and the "
        "optimizer state is reset unless every parameter loaded). A dropout change never needs it.",
        False,
    )
    io_retries: int = doc(
        "Further attempts at a checkpoint save or load whose file I/O failed with a transient storage error (EIO, "
        "ESTALE, ETIMEDOUT, ...: a network file system's fail-over). A save is retried whole, on every rank, from a "
        "fresh temporary folder; the previous generation is never touched. Then the launch fails as a crash and is "
        "restarted (job.max_failures). A full disk or a permission error is not retried; 0 = no retries.",
        5,
    )
    io_retry_backoff_s: float = doc(
        "Seconds before the first retry of a checkpoint save or load; each next one waits twice as long (at most "
        "30 s, with jitter), and no retry starts later than 120 s after the first attempt.",
        1.0,
    )

    def check(self) -> Problems:
        out: Problems = []
        if self.every_steps < 0:
            out.append(("every_steps", f"must be >= 0, got {self.every_steps}"))
        if self.every_minutes < 0:
            out.append(("every_minutes", f"must be >= 0, got {self.every_minutes}"))
        if self.keep_last < 2:
            out.append(("keep_last", f"must be >= 2 (never keep only one generation), got {self.keep_last}"))
        if self.keep_every < 0:
            out.append(("keep_every", f"must be >= 0, got {self.keep_every}"))
        for name in self.stop_signals:
            if name not in SIGNAL_NAMES:
                out.append(("stop_signals", f"{name!r} is not one of {', '.join(SIGNAL_NAMES)}"))
        if self.io_retries < 0:
            out.append(("io_retries", f"must be >= 0, got {self.io_retries}"))
        if not 0 < self.io_retry_backoff_s <= 60:
            out.append(("io_retry_backoff_s", f"must be in (0, 60] seconds, got {self.io_retry_backoff_s}"))
        return out


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    tensorboard: bool = doc("Write TensorBoard event files to RUN_DIR/tensorboard/ (rank 0).", True)
    straggler_every: int = doc(
        "Every N steps the ranks compare their busy time per step (step time minus time spent waiting in "
        "collectives); 0 = off.",
        50,
    )
    straggler_margin: float = doc(
        "A rank or node busier than the median by more than this fraction is a straggler.", 0.2
    )
    straggler_exclude_after: int = doc(
        "A node that is a straggler in this many straggler checks in a row is named bad: the ranks commit a "
        "checkpoint at that step and the launch ends, so that the launcher leaves the node out (in the job down to "
        "job.min_nodes, else in a new job; see job.min_nodes). 0 = only warn.",
        0,
    )
    hang_timeout_s: float = doc(
        "A collective or step phase that does not finish within this many seconds ends the job with the ranks "
        "that did not arrive named and a stack dump of every live rank; 0 = off.",
        600.0,
    )
    heartbeat_s: float = doc("How often each rank publishes its progress for the hang watchdog.", 2.0)
    peak_tflops: float = doc(
        "Peak bf16 dense TFLOP/s of one device for MFU; 0 = looked up from the GPU's name (no MFU on CPU).", 0.0
    )
    device_sync: bool = doc(
        "On GPU, synchronize the device at each phase boundary of a step and time the phases (data, compute, comm, "
        "optim) with the host clock. false: CUDA events around each phase, read a step later, give the device's "
        "time of each phase without draining the GPU's queue mid-step (the synchronizations cost 4 % of a "
        "device-bound step on one H100). No effect on CPU.",
        False,
    )
    profile_steps: str = doc(
        "'A-B': record optimizer steps A..B of each launch with torch.profiler on every rank (host operators; on "
        "GPUs also kernels, copies and NCCL): RUN_DIR/profile/rank_N.json (Chrome trace, for Perfetto) and "
        "rank_N.txt (the top operators). Empty = off. At most 20 steps (traces grow fast).",
        "",
    )
    log_every_s: float = doc("Rank 0's plain progress line in batch logs at most this often (seconds).", 30.0)
    preflight: Literal["off", "warn", "exclude", False] = doc(
        "Gang preflight before step 0 of every launch (well under a second): each rank's device and free memory, a "
        "compute probe, the all-reduce on its intra- and inter-node groups (bandwidth, latency), a ping-pong with "
        "its neighbour nodes (3+ nodes) and the first data item it reads, in one history event. A node below the "
        "median of the other nodes by more than monitor.preflight_margin, or whose ranks cannot read their data, in "
        "two measurements (the second runs only when the first names a node), is named: warn = logged and "
        "recorded; exclude = the launch fails with failure.json naming the node (the launcher leaves it out); off = "
        "no preflight (YAML reads a bare off as false: the same).",
        "warn",
    )
    preflight_margin: float = doc(
        "The preflight names a node whose bandwidth, compute or free memory is below the median of the other "
        "nodes by more than this fraction (0.5: less than half).",
        0.5,
    )
    preflight_mib: float = doc(
        "MiB per rank moved by each timed all-reduce and ping-pong of the preflight; 0 = 64 on GPUs, 4 on CPU (large "
        "enough to time bandwidth rather than latency).",
        0.0,
    )

    def check(self) -> Problems:
        out: Problems = []
        if not 0 < self.preflight_margin < 1:
            out.append(("preflight_margin", f"must be in (0, 1), got {self.preflight_margin}"))
        if not 0 <= self.preflight_mib <= 256:
            out.append(("preflight_mib", f"must be between 0 (auto) and 256 (a short check), got {self.preflight_mib}"))
        if self.straggler_every < 0:
            out.append(("straggler_every", f"must be >= 0, got {self.straggler_every}"))
        if self.straggler_margin <= 0:
            out.append(("straggler_margin", f"must be > 0, got {self.straggler_margin}"))
        if self.straggler_exclude_after < 0:
            out.append(("straggler_exclude_after", f"must be >= 0, got {self.straggler_exclude_after}"))
        elif self.straggler_exclude_after and not self.straggler_every:
            out.append(("straggler_exclude_after", "needs straggler checks: monitor.straggler_every is 0"))
        if self.hang_timeout_s < 0:
            out.append(("hang_timeout_s", f"must be >= 0, got {self.hang_timeout_s}"))
        if not self.heartbeat_s > 0:
            out.append(("heartbeat_s", f"must be > 0, got {self.heartbeat_s}"))
        if self.hang_timeout_s and self.hang_timeout_s < 3 * self.heartbeat_s:
            out.append(("hang_timeout_s", f"must be at least 3 x monitor.heartbeat_s ({3 * self.heartbeat_s:g})"))
        if self.peak_tflops < 0:
            out.append(("peak_tflops", f"must be >= 0, got {self.peak_tflops}"))
        if self.log_every_s < 0:
            out.append(("log_every_s", f"must be >= 0, got {self.log_every_s}"))
        if self.profile_steps:
            try:
                self.profile_range()
            except ValueError as exc:
                out.append(("profile_steps", str(exc)))
        return out

    def profile_range(self) -> tuple[int, int] | None:
        """(first, last) optimizer steps to profile, 1-based and inclusive; None when off. Raises ValueError."""
        if not self.profile_steps:
            return None
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(self.profile_steps))
        if not m:
            raise ValueError(f"must be 'FIRST-LAST' (optimizer steps, e.g. '10-12'), got {self.profile_steps!r}")
        first, last = int(m.group(1)), int(m.group(2))
        if not 1 <= first <= last or last - first >= 20:
            raise ValueError(f"needs 1 <= FIRST <= LAST and at most 20 steps, got {self.profile_steps!r}")
        return first, last


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    recipe: str = doc(
        "What to train: 'module:function' of a recipe (the user's model, data and loss; see trainer/recipes/api.py), "
        "or 'gpt', the built-in byte-level GPT. The module is found in the config file's folder, the current folder "
        "or the installed packages, and snapshotted into the run directory at submit time.",
        "gpt",
    )
    recipe_args: dict[str, Any] = doc("Keyword arguments of the recipe function (free mapping).", factory=dict)
    job: JobConfig = doc("Job shape: nodes and ranks.", factory=JobConfig)
    model: ModelConfig = doc("The built-in GPT's shape (recipe: gpt only).", factory=ModelConfig)
    data: DataConfig = doc(
        "Sample order (seed), prefetch, and the prepared HDF5 token data that token-based recipes read.",
        factory=DataConfig,
    )
    train: TrainConfig = doc("Optimisation loop.", factory=TrainConfig)
    comm: CommConfig = doc("Gradient communication.", factory=CommConfig)
    parallel: ParallelConfig = doc(
        "How the model is split over the ranks: data-parallel replicas and FSDP2 shards (HSDP), see "
        "runconfig/layout.py.",
        factory=ParallelConfig,
    )
    checkpoint: CheckpointConfig = doc("Checkpoints, stop signals and resume.", factory=CheckpointConfig)
    monitor: MonitorConfig = doc("Metrics, TensorBoard, stragglers and the hang watchdog.", factory=MonitorConfig)

    def check(self) -> Problems:
        """Checks that span sections."""
        out: Problems = []
        if not RECIPE_RE.match(self.recipe):
            out.append(("recipe", f"{self.recipe!r} must be 'gpt' or 'package.module:function'"))
        elif self.recipe != BUILTIN_RECIPE and self.model != ModelConfig():
            out.append(
                (
                    "model",
                    f"configures the built-in gpt recipe; recipe {self.recipe} takes its settings from recipe_args",
                )
            )
        if self.recipe == BUILTIN_RECIPE and self.recipe_args:
            out.append(("recipe_args", "the built-in gpt recipe takes its settings from the model section"))
        if self.job.signal not in self.checkpoint.stop_signals:
            out.append(
                (
                    "job.signal",
                    f"{self.job.signal} is not in checkpoint.stop_signals {self.checkpoint.stop_signals}: "
                    "the trainer would not stop on it",
                )
            )
        out += self._layout_problems()
        if self.monitor.preflight == "exclude" and self.job.nodes == 1:
            out.append(
                (
                    "monitor.preflight",
                    "exclude needs job.nodes >= 2: the preflight compares a node with the other nodes, and one node "
                    "has none to be compared with or to leave it out for (use warn)",
                )
            )
        if self.monitor.straggler_exclude_after and self.job.nodes == 1:
            out.append(("monitor.straggler_exclude_after", "needs job.nodes >= 2: one node has no peers to lag behind"))
        job = self.job
        nccl = self.comm.backend == "nccl" or (self.comm.backend == "auto" and self.train.device != "cpu")
        if nccl and 0 < job.gpus_per_node < job.ranks_per_node:
            out.append(
                (
                    "job.ranks_per_node",
                    f"{job.ranks_per_node} ranks per node on {job.gpus_per_node} GPU(s) per node (job.gpus_per_node): "
                    "NCCL allows one rank per GPU. Set ranks_per_node to the GPUs per node, or comm.backend: gloo "
                    "(or train.device: cpu) for ranks that share a GPU",
                )
            )
        if self.monitor.hang_timeout_s and self.monitor.hang_timeout_s < 2 * self.checkpoint.io_retry_backoff_s:
            out.append(
                (
                    "monitor.hang_timeout_s",
                    f"{self.monitor.hang_timeout_s:g} s would end a checkpoint save that is waiting out a storage "
                    f"retry (checkpoint.io_retry_backoff_s={self.checkpoint.io_retry_backoff_s:g})",
                )
            )
        return out

    def layout(self, world_size: int | None = None) -> Layout:
        """The parallel layout on ``world_size`` ranks (default: the job's); raises LayoutError."""
        return resolve(self.parallel.degrees(), world_size or self.job.world_size, self.job.ranks_per_node)

    def _layout_problems(self) -> Problems:
        """The layout must resolve, and the global batch split over its data-parallel ranks, at the job's size
        and at every smaller size job.min_nodes lets the run continue on."""
        t, job = self.train, self.job
        for nodes in range(job.nodes, job.min_nodes_or_all - 1, -1):
            world = nodes * job.ranks_per_node
            shrunk = nodes < job.nodes
            where = f"on {nodes} of job.nodes={job.nodes} (job.min_nodes={job.min_nodes}), " if shrunk else ""
            try:
                layout = self.layout(world)
            except LayoutError as exc:
                key = "job.min_nodes" if shrunk else f"parallel.{exc.key}"
                return [(key, f"{where}{exc} (world size {world} = {nodes} nodes x {job.ranks_per_node} ranks)")]
            if self.comm.compress != "none" and layout.uses_mesh:
                return [
                    (
                        "comm.compress",
                        f"{self.comm.compress} compresses DDP's gradient all-reduce; the {layout.kind} layout "
                        "reduces gradients through FSDP2 (set comm.compress: none)",
                    )
                ]
            if layout.pp > 1 and not shrunk:
                n = self.parallel.microbatches(layout.pp)
                if n < layout.pp:
                    return [("parallel.pp_microbatches", f"{n} is fewer than the {layout.pp} pipeline stages")]
                if t.micro_batch_size % n:
                    key = "parallel.pp_microbatches" if self.parallel.pp_microbatches else "parallel.pp"
                    return [
                        (
                            key,
                            f"{n} pipeline micro-batches do not divide train.micro_batch_size={t.micro_batch_size}",
                        )
                    ]
                if t.eval_every and t.eval_sequences < t.micro_batch_size * layout.dp:
                    return [
                        (
                            "train.eval_sequences",
                            f"{t.eval_sequences} is fewer than one micro-batch ({t.micro_batch_size}) per "
                            f"data-parallel rank ({layout.dp}): a pipeline evaluates whole micro-batches",
                        )
                    ]
                if self.recipe == BUILTIN_RECIPE and layout.pp > self.model.n_layers:
                    return [
                        (
                            "parallel.pp",
                            f"{layout.pp} stages for model.n_layers={self.model.n_layers}: each stage needs a block",
                        )
                    ]
            if self.recipe == BUILTIN_RECIPE and layout.tp > 1:
                m = self.model
                for what, size in (
                    ("model.n_heads", m.n_heads),
                    ("model.mlp_ratio x model.d_model", m.mlp_ratio * m.d_model),
                ):
                    if size % layout.tp:
                        return [
                            (
                                "parallel.tp",
                                f"{where}{layout.tp} does not divide {what} = {size}: the built-in GPT's tensor "
                                "parallelism splits attention heads and MLP units evenly over the group",
                            )
                        ]
            if t.global_batch_size % (t.micro_batch_size * layout.dp):
                ranks = f"{nodes} nodes x {job.ranks_per_node} ranks = {world}"
                dp = f"data-parallel size ({ranks})" if layout.dp == world else f"data-parallel size {layout.dp}"
                if shrunk:
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
                        f"{t.global_batch_size} is not a multiple of train.micro_batch_size ({t.micro_batch_size}) "
                        f"x {over}",
                    )
                ]
        return []

    def grad_accum(self, world_size: int | None = None) -> int:
        """Micro-batches per optimizer step on ``world_size`` ranks (default: the job's): the global batch over
        micro-batch x the layout's data-parallel ranks (tensor and pipeline ranks share their micro-batches)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.layout(world_size).dp)
