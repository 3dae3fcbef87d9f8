"""``monitor.profile_steps: A-B``: torch.profiler over optimizer steps A..B of a launch, on every rank.

Each rank writes ``RUN_DIR/profile/rank_NNNNN.json`` (a Chrome trace: open it in https://ui.perfetto.dev or
chrome://tracing) and ``rank_NNNNN.txt`` (torch's table of the operators that took the most time: device time on
GPUs, host time on CPU). On GPUs the trace holds the kernels, memory copies and NCCL collectives on their streams
beside the host's Python and operator calls, which is where idle gaps in the device's timeline show. Steps a
launch does not run (resumed past them) are not recorded; a launch that ends inside the range writes what it has.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

log = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, first: int, last: int, device: torch.device, folder: Path, rank: int) -> None:
        self.first, self.last, self.device, self.folder, self.rank = first, last, device, folder, rank
        self._prof: profile | None = None
        self._mark: record_function | None = None  # "optimizer step N" around each step, in the trace
        self._done = False
        self._steps: list[int] = []

    def before(self, step: int) -> None:
        """Called before optimizer step ``step``."""
        if self._prof is None and not self._done and self.first <= step <= self.last:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        if self._prof is not None:
            self._steps.append(step)
            self._mark = record_function(f"optimizer step {step}")
            self._mark.__enter__()

    def after(self, step: int) -> None:
        """Called after step ``step`` (its boundary, record and checkpoint included)."""
        self._end_mark()
        if self._prof is not None and step >= self.last:
            self.close()

    def _end_mark(self) -> None:
        mark, self._mark = self._mark, None
        if mark is not None:
            mark.__exit__(None, None, None)

    def close(self) -> None:
        """Stop and write what was recorded (also when the launch ends inside the range)."""
        self._end_mark()
        prof, self._prof = self._prof, None
        if prof is None:
            return
        self._done = True
        prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"rank_{self.rank:05d}"
        prof.export_chrome_trace(str(self.folder / f"{name}.json"))
        key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        steps = f"steps {self._steps[0]}-{self._steps[-1]}"
        table = prof.key_averages().table(sort_by=key, row_limit=30)
        (self.folder / f"{name}.txt").write_text(f"rank {self.rank}, {steps}, sorted by {key}\n{table}\n")
        if self.rank == 0:
            log.info("profile of %s written to %s (a Chrome trace and a table per rank)", steps, self.folder)
