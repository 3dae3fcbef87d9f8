"""The whole run configuration: the top-level keys, the sections, and the checks that span sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runconfig.layout import Layout, resolve
from runconfig.schema.checkpoint import CheckpointConfig
from runconfig.schema.comm import CommConfig
from runconfig.schema.cost import CostConfig
from runconfig.schema.data import DataConfig
from runconfig.schema.feasible import layout_problems
from runconfig.schema.fields import Problems, doc
from runconfig.schema.job import JobConfig
from runconfig.schema.live import LiveConfig
from runconfig.schema.model import ModelConfig
from runconfig.schema.monitor import MonitorConfig
from runconfig.schema.parallel import ParallelConfig
from runconfig.schema.prune import PruneConfig
from runconfig.schema.recipe import BUILTIN_RECIPE, RECIPE_RE
from runconfig.schema.storage import StorageConfig
from runconfig.schema.tracking import TrackingConfig
from runconfig.schema.train import TrainConfig


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
    storage: StorageConfig = doc(
        "Object storage (s3:// and other fsspec URLs): endpoint and retries; credentials come from the environment.",
        factory=StorageConfig,
    )
    monitor: MonitorConfig = doc("Metrics, TensorBoard, stragglers and the hang watchdog.", factory=MonitorConfig)
    tracking: TrackingConfig = doc(
        "Experiment tracking (MLflow by default, W&B offline): one tracker run per run directory.",
        factory=TrackingConfig,
    )
    live: LiveConfig = doc(
        "Live metrics for Prometheus: an endpoint per node, or pushes to a Pushgateway.", factory=LiveConfig
    )
    cost: CostConfig = doc(
        "Prices of a node-hour or a GPU-hour, for the run's cost in its reports.", factory=CostConfig
    )
    prune: PruneConfig = doc(
        "Early stopping of a sweep's poor elements (ASHA), set by `python -m hpc sweep`.", factory=PruneConfig
    )

    def check(self) -> Problems:
        """Checks that span sections."""
        return self._recipe_problems() + layout_problems(self) + self._feature_problems() + self._device_problems()

    def _recipe_problems(self) -> Problems:
        out: Problems = []
        if not RECIPE_RE.fullmatch(self.recipe):
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
        return out

    def _feature_problems(self) -> Problems:
        """Features that need another key set, or more than one node."""
        out: Problems = []
        late = [s for s in self.prune.at_steps if s >= self.train.steps]
        if self.prune.metric is not None and late:
            out.append(("prune.at_steps", f"{late} are not before train.steps={self.train.steps}: nothing to prune"))
        if self.model.doc_mask and self.parallel.pp > 1:
            out.append(("model.doc_mask", "is not available with pipeline parallelism (parallel.pp > 1) yet: a later "
                        "stage sees hidden states, not the tokens whose documents the mask is made from"))  # fmt: skip
        if self.monitor.preflight == "exclude" and self.job.nodes == 1:
            out.append(
                (
                    "monitor.preflight",
                    "exclude needs job.nodes >= 2: the preflight compares a node with the other nodes, and one node "
                    "has none to be compared with or to leave it out for (use warn)",
                )
            )
        if self.job.retake_nodes_after_s and self.monitor.preflight != "exclude":
            out.append(("job.retake_nodes_after_s", "needs monitor.preflight: exclude, which checks a node taken back "
                        "at the launch it rejoins and names it bad again if it fails"))  # fmt: skip
        if self.monitor.straggler_exclude_after and self.job.nodes == 1:
            out.append(("monitor.straggler_exclude_after", "needs job.nodes >= 2: one node has no peers to lag behind"))
        p = self.parallel
        if self.job.spare_ranks and (p.dp_shard != 1 or p.cp != 1 or p.tp != 1 or p.pp != 1):
            out.append(("job.spare_ranks", "in-process restarts keep each survivor's whole replica: data-parallel "
                        "layouts only (this config sets parallel degrees above 1)"))  # fmt: skip
        if self.job.spare_ranks and not self.checkpoint.resume:
            out.append(("job.spare_ranks", "an in-process restart restores the newest checkpoint, which "
                        "checkpoint.resume: false forbids (set it to true, or job.spare_ranks to 0)"))  # fmt: skip
        return out + self._sync_problems()

    def _sync_problems(self) -> Problems:
        """comm.sync=diloco or local_sgd: a DDP layout, and checkpoints at the rounds' ends."""
        comm, ckpt = self.comm, self.checkpoint
        if comm.sync == "ddp":
            if comm.sync_fragments != 1:
                return [("comm.sync_fragments", f"{comm.sync_fragments} fragments stream the meetings of "
                         "comm.sync=diloco or local_sgd rounds; comm.sync is ddp")]  # fmt: skip
            return []
        out: Problems = []
        if comm.sync_every % comm.sync_fragments:
            out.append(("comm.sync_fragments", f"{comm.sync_fragments} does not divide comm.sync_every="
                        f"{comm.sync_every}: each fragment meets at a whole step of the round"))  # fmt: skip
        p = self.parallel
        if p.dp_shard != 1 or p.cp != 1 or p.tp != 1 or p.pp != 1:
            out.append(("comm.sync", f"{comm.sync} averages whole replicas between nodes: DDP layouts only (this "
                        "config sets parallel degrees above 1)"))  # fmt: skip
        for key, every in (("every_steps", ckpt.every_steps), ("memory_every_steps", ckpt.memory_every_steps)):
            if every % comm.sync_every:
                out.append((f"checkpoint.{key}", f"{every} is not a multiple of comm.sync_every={comm.sync_every}: "
                            f"with comm.sync={comm.sync} checkpoints are taken at the rounds' ends"))  # fmt: skip
        late = [s for s in self.prune.at_steps if s % comm.sync_every]
        if self.prune.metric is not None and late:
            out.append(("prune.at_steps", f"{late} are not multiples of comm.sync_every={comm.sync_every}: a rung's "
                        f"checkpoint is taken at a round's end with comm.sync={comm.sync}"))  # fmt: skip
        return out

    def _device_problems(self) -> Problems:
        """Ranks against GPUs, and the hang timeout against the storage retries."""
        out: Problems = []
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

    def grad_accum(self, world_size: int | None = None) -> int:
        """Micro-batches per optimizer step on ``world_size`` ranks (default: the job's): the global batch over
        micro-batch x the layout's data-parallel ranks (tensor and pipeline ranks share their micro-batches)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.layout(world_size).dp)
