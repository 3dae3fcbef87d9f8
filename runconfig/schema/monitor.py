"""Metrics, TensorBoard, stragglers, the gang preflight, profiles and the hang watchdog."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from runconfig.schema.fields import Problems, Range, Section, doc


@dataclass(frozen=True, kw_only=True)
class MonitorConfig(Section):
    tensorboard: bool = doc("Write TensorBoard event files to RUN_DIR/tensorboard/ (rank 0).", True)
    straggler_every: int = doc(
        "Every N steps the ranks compare their busy time per step (step time minus time spent waiting in "
        "collectives); 0 = off.",
        50,
        bounds=Range(ge=0),
    )
    straggler_margin: float = doc(
        "A rank or node busier than the median by more than this fraction is a straggler.",
        0.2,
        bounds=Range(gt=0),
    )
    straggler_exclude_after: int = doc(
        "A node that is a straggler in this many straggler checks in a row is named bad: the ranks commit a "
        "checkpoint at that step and the launch ends, so that the launcher leaves the node out (in the job down to "
        "job.min_nodes, else in a new job; see job.min_nodes). 0 = only warn.",
        0,
        bounds=Range(ge=0),
    )
    replica_check_every: int = doc(
        "Every N steps, and before every checkpoint is saved, the data-parallel replicas (DDP's ranks, HSDP's "
        "replicas of each shard) compare a digest of their weights, which must be bit-identical: a replica that "
        "differs from the majority is named with its node, the launch ends without a checkpoint and the run "
        "restarts from the newest committed one (checked at its step) with that node left out. 0 = off.",
        0,
        bounds=Range(ge=0),
    )
    hang_timeout_s: float = doc(
        "A collective or step phase that does not finish within this many seconds ends the job with the ranks "
        "that did not arrive named and a stack dump of every live rank; 0 = off.",
        600.0,
        bounds=Range(ge=0),
    )
    startup_timeout_s: float = doc(
        "A rank not through the rendezvous (imports, MPI_Init, the process groups) this many seconds after its "
        "process started writes every thread's stack to its log and exits 1: the launch fails and is restarted "
        "like a crash, rather than hanging where the hang watchdog does not yet watch. 0 = off.",
        600.0,
        bounds=Range(ge=0),
    )
    peer_timeout_s: float = doc(
        "A rank whose heartbeats stop for this long (its process ended, its node went down, its link was lost) ends "
        "the launch on the other ranks, named with its node, rather than leaving them blocked in a collective until "
        "the scheduler notices (Slurm: SlurmdTimeout, then KillWait). Watched by rank 0, which hosts the rendezvous "
        "store: a rank that loses the store for this long ends too. With job.spare_ranks the launch's keeper counts a "
        "rank or spare unheard this long dead instead, and a spare of another node takes a rank's place. At least 3 x "
        "monitor.heartbeat_s; 0 = off.",
        15.0,
        bounds=Range(ge=0),
    )
    rejoin_timeout_s: float = doc(
        "With job.spare_ranks: seconds a rank whose collective failed waits for the keeper's plan of the next "
        "generation (a spare in the dead rank's place) before it gives up and the launch restarts. Joining the "
        "new generation's process groups is bounded by comm.timeout_s.",
        30.0,
        bounds=Range(gt=0),
    )
    heartbeat_s: float = doc(
        "How often each rank publishes its progress for the hang watchdog.", 2.0, bounds=Range(gt=0)
    )
    peak_tflops: float = doc(
        "Peak bf16 dense TFLOP/s of one device for MFU; 0 = looked up from the GPU's name (no MFU on CPU).",
        0.0,
        bounds=Range(ge=0),
    )
    device_sync: bool = doc(
        "On GPU, synchronize the device at each phase boundary of a step and time the phases (data, compute, comm, "
        "optim) with the host clock. false: CUDA events around each phase, read a step later, give the device's "
        "time of each phase without draining the GPU's queue mid-step (the synchronizations slow a device-bound "
        "step: docs/measurements/gpu.md). No effect on CPU.",
        False,
    )
    comm_by_dim: bool = doc(
        "On CPU, in the layouts whose forward is collective (FSDP2, HSDP, tensor and pipeline parallelism), time the "
        "training thread's waits in their collectives per parallel dimension (comm_by_dim and time_comm_s; a "
        "schedstat read around each collective, through FSDP2's custom-collective interface). false: those waits "
        "count as compute. DDP's exposed communication and GPUs are measured either way.",
        True,
    )
    profile_steps: str = doc(
        "'A-B': record optimizer steps A..B of each launch with torch.profiler on every rank (host operators; on "
        "GPUs also kernels, copies and NCCL): RUN_DIR/profile/rank_N.json (Chrome trace, for Perfetto) and "
        "rank_N.txt (the top operators). Empty = off. At most 20 steps (traces grow fast).",
        "",
    )
    log_every_s: float = doc(
        "Rank 0's plain progress line in batch logs at most this often (seconds).", 30.0, bounds=Range(ge=0)
    )
    preflight: Literal["off", "warn", "exclude", False] = doc(
        "Gang preflight before step 0 of every launch: each rank's device and free memory, a "
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
        bounds=Range(gt=0, lt=1),
    )
    preflight_mib: float = doc(
        "MiB per rank moved by each timed all-reduce and ping-pong of the preflight; 0 = 64 on GPUs, 4 on CPU (large "
        "enough to time bandwidth rather than latency).",
        0.0,
        bounds=Range(ge=0, le=256, text="between 0 (auto) and 256 (a short check)"),
    )

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

    def relations(self) -> Problems:
        out: Problems = []
        if self.straggler_exclude_after > 0 and not self.straggler_every:
            out.append(("straggler_exclude_after", "needs straggler checks: monitor.straggler_every is 0"))
        if self.hang_timeout_s and self.hang_timeout_s < 3 * self.heartbeat_s:
            out.append(("hang_timeout_s", f"must be at least 3 x monitor.heartbeat_s ({3 * self.heartbeat_s:g})"))
        if self.peer_timeout_s and self.peer_timeout_s < 3 * self.heartbeat_s:
            out.append(("peer_timeout_s", f"must be at least 3 x monitor.heartbeat_s ({3 * self.heartbeat_s:g})"))
        if self.profile_steps:
            try:
                self.profile_range()
            except ValueError as exc:
                out.append(("profile_steps", str(exc)))
        return out
