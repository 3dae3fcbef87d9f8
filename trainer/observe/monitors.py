"""What watches the training loop, built in one place: the step clock, the hang watchdog, straggler checks,
TensorBoard, rank 0's terminal progress bar, injected faults (tests) and the MFU constants; the tracker and the
live metrics are opened beside them (collectively) and kept here."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from runconfig import RunConfig
from rundir import RunDir
from rundir.progress import Progress
from trainer.env import RuntimeEnv
from trainer.observe.inject import Injector
from trainer.observe.live import LiveMetrics
from trainer.observe.replicas import ReplicaCheck
from trainer.observe.stragglers import StragglerCheck
from trainer.observe.tboard import TensorBoard
from trainer.observe.timing import StepClock, memory_now_mb, peak_tflops
from trainer.observe.tracker_sink import Tracker
from trainer.observe.watchdog import Watchdog
from trainer.parallel.distributed import Distributed
from trainer.parallel.storeseal import Seal


@dataclass
class Monitors:
    """What watches the loop: the step clock, the hang watchdog, straggler checks, TensorBoard, the terminal
    progress bar and injected faults (tests). Built by ``trainer.main``; each has one job."""

    clock: StepClock
    watchdog: Watchdog
    stragglers: StragglerCheck
    tensorboard: TensorBoard
    progress: Progress | None  # rank 0 on a terminal only; batch logs get plain lines
    injector: Injector
    flops_per_sample: float | None  # training FLOPs of one sample (the recipe's, or counted); None without MFU
    peak_flops: float | None  # per device, FLOP/s; None: no MFU (CPU or unknown GPU)
    tracker: Tracker | None = None  # rank 0's MLflow or W&B run (tracking.*), None elsewhere or when off
    live: LiveMetrics | None = None  # each node's first rank's Prometheus metrics (live.*), None elsewhere or off
    replicas: ReplicaCheck | None = None  # the replicas' weights compared (monitor.replica_check_every)

    def close(self) -> None:
        if self.live is not None:  # its last push shows the last record
            self.live.close()
        self.watchdog.close()
        self.clock.close()
        self.tensorboard.close()
        if self.progress is not None:
            self.progress.close()


def build_monitors(
    cfg: RunConfig,
    env: RuntimeEnv,
    distributed: Distributed,
    model: torch.nn.Module,
    rundir: RunDir,
    flops_per_sample: float | None,
    *,
    ddp: bool,
    tracker: Tracker | None = None,
) -> Monitors:
    """``flops_per_sample``: the training FLOPs of one sample where MFU is reported (a known peak: GPU, or
    monitor.peak_tflops), else None. ``ddp``: the model is DDP's (its exposed communication is the data-parallel
    all-reduce's)."""
    watchdog = Watchdog(
        env,
        cfg.monitor,
        rundir,
        distributed.store_addr,
        distributed.store_port,
        Seal(distributed.store_secret, env.rank),
        heartbeats=cfg.live.enabled,  # live metrics show each rank's heartbeat
        memory=lambda: memory_now_mb(distributed.device),
        prefix=distributed.store_prefix,
    )
    watchdog.start()
    distributed.groups.blocked.on_block = watchdog.block
    params = [p for p in model.parameters() if p.requires_grad]
    tflops = peak_tflops(distributed.device, cfg.monitor.peak_tflops)
    return Monitors(
        clock=StepClock(
            distributed.device,
            params,
            distributed.groups.blocked,
            lambda: watchdog.enter("waiting for the gradient all-reduce"),
            ledger=distributed.ledger,
            tail_dim="dp_replicate" if ddp else None,
            device_sync=cfg.monitor.device_sync,
        ),
        watchdog=watchdog,
        stragglers=StragglerCheck(env, cfg.monitor, distributed.device),
        tensorboard=TensorBoard(rundir.tensorboard, cfg.monitor.tensorboard and env.rank == 0),
        progress=Progress(cfg.train.steps) if env.rank == 0 and sys.stdout.isatty() else None,
        injector=Injector(env.inject, env.rank),
        flops_per_sample=flops_per_sample if tflops else None,
        peak_flops=tflops * 1e12 if tflops else None,
        tracker=tracker,
    )
