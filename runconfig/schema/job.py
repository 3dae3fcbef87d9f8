"""The job's shape (nodes, ranks) and what the Slurm script and the launchers make of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runconfig.schema.fields import Problems, Range, Section, doc
from runconfig.schema.slurm_syntax import names_problems, slurm_minutes, words_problems


@dataclass(frozen=True, kw_only=True)
class JobConfig(Section):
    name: str = doc("Run name: letters, digits, '.', '_', '-' (at most 64); names the run directory.", "run")
    nodes: int = doc("Number of nodes. Locally they are simulated on one host.", 1, bounds=Range(ge=1))
    ranks_per_node: int = doc("Processes (ranks) per node; one per GPU on GPU nodes.", 1, bounds=Range(ge=1))
    threads_per_rank: int = doc(
        "torch intra-op threads per rank; 0 = cores on the host / local ranks.", 0, bounds=Range(ge=0)
    )
    # Slurm: each of these maps onto the generated sbatch script (hpc/slurm.py); unset ones are left out.
    gpus_per_node: int = doc(
        "GPUs per node (--gpus-per-node); usually = ranks_per_node on GPU nodes.", 0, bounds=Range(ge=0)
    )
    cpus_per_task: int = doc("CPUs per rank (--cpus-per-task).", 1, bounds=Range(ge=1))
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
    signal_lead_s: int = doc("Seconds before the time limit at which the signal is sent.", 120, bounds=Range(ge=10))
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
    max_requeues: int = doc(
        "Requeues after a stop (time limit, preemption) before giving up (its old name, max_restarts, is still read).",
        20,
        bounds=Range(ge=0),
    )
    max_failures: int = doc(
        "In-job restarts per run after a launch fails through no fault of the input (a rank killed or crashed, a "
        "collective failed, a hang): the ranks restart in the same allocation from the newest valid checkpoint. "
        "Bad input (exit status 2) is never retried; 0 turns restarts off.",
        3,
        bounds=Range(ge=0),
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
    no_kill: bool = doc(
        "Keep the job's allocation when one of its nodes fails (sbatch --no-kill): the ranks on the other nodes end "
        "the launch and the run restarts in the same job on the nodes left, without the queue (at least "
        "job.min_nodes; too few left, it continues in a new job). The job stays that size until it ends and the lost "
        "node is not replaced. false: Slurm ends the whole job with NODE_FAIL and requeues it, back through the "
        "queue, at full size on healthy nodes.",
        False,
    )
    retake_nodes_after_s: float = doc(
        "Seconds after which a bad node is taken back at the run's next launch (an in-job restart or a new job), "
        "unless Slurm still holds it down or drained; the gang preflight (monitor.preflight: exclude, required) "
        "checks it there and names it bad again if it fails. 0 = only by hand: python -m hpc unexclude RUN NODE.",
        0.0,
        bounds=Range(ge=0),
    )
    spare_ranks: int = doc(
        "Warm spare processes per launch (the local launcher and Slurm's driver, gloo): started beside the ranks "
        "(under Slurm an srun step each, on the launch's nodes), they import and wait. "
        "With spares, a rank that dies is restarted in the same processes: the survivors leave the broken process "
        "groups, a spare takes the dead rank's place, every rank restores the newest checkpoint in node memory "
        "(else the durable one) and training goes on, without a new launch. Data-parallel layouts only. With no "
        "spare ready, past job.max_failures in-process restarts, with no plan within monitor.rejoin_timeout_s, or "
        "with no checkpoint yet to restore, the launch restarts as without spares. 0 = off.",
        0,
        bounds=Range(ge=0, le=64),
    )
    restart_backoff_s: float = doc(
        "Seconds before the first in-job restart of a run; each further restart waits twice as long (at most 300).",
        5.0,
        bounds=Range(ge=0, le=3600, text="between 0 and 3600 seconds"),
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

    def relations(self) -> Problems:
        out = names_problems(self) + words_problems(self)
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            out.append(("min_nodes", f"must be between 1 and job.nodes={self.nodes}, got {self.min_nodes}"))
        elif self.min_nodes is not None and self.min_nodes < self.nodes and self.max_failures == 0:
            out.append(("min_nodes", "continuing on fewer nodes needs in-job restarts: job.max_failures is 0"))
        minutes = slurm_minutes(self.time)
        if self.signal_lead_s >= 10 and minutes and self.signal_lead_s >= minutes * 60:
            out.append(("signal_lead_s", f"{self.signal_lead_s} s is not shorter than the time limit {self.time}"))
        return out
