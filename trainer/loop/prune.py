"""A sweep element's rungs (prune.*): at each rung step rank 0 reports the step's prune.metric to the sweep's rung
file and judges it by ASHA's rule (rundir/rungs.py); every rank learns the verdict. A pruned element ends like a
completed one, with the rung's checkpoint committed and a "pruned" event: not failed, not requeued."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict

import torch.distributed as dist

from runconfig import RunConfig
from rundir import RunDir
from rundir.paths import read_jsonl
from rundir.rungs import report, rungs_path
from trainer.errors import UserError

log = logging.getLogger(__name__)


class Pruned(Exception):
    """Raised by every rank after a rung's verdict; ``info``: the verdict and its one-line description."""

    def __init__(self, info: dict) -> None:
        super().__init__(info["why"])
        self.info = info


class Pruner:
    def __init__(self, cfg: RunConfig, rundir: RunDir, rank: int) -> None:
        self.cfg, self.rundir, self.rank = cfg.prune, rundir, rank
        self.steps = set(cfg.prune.at_steps) if cfg.prune.metric else set()

    def due(self, step: int) -> bool:
        return step in self.steps

    def judge(self, step: int, record: dict | None, resumed: bool = False) -> None:
        """Collective, at a rung step once its record is written: raises Pruned on every rank when pruned."""
        out = self._verdict(step, record, resumed) if self.rank == 0 else None
        shared = [out]
        dist.broadcast_object_list(shared, src=0)
        out = shared[0]
        if "error" in out:
            raise UserError(out["error"], collective=True, rank=0)
        if self.rank == 0:
            log.info("rung: %s: %s", out["why"], "pruned" if out["prune"] else "continues")
        if out["prune"]:
            raise Pruned(out)

    def judge_resumed(self, step: int) -> None:
        """Collective, before the first step of a launch that resumed from a rung step's checkpoint: the launch
        before may have been killed between that checkpoint's commit and the verdict, so the rung is judged (again:
        the rung file keeps the element's first report) from the step's record in metrics.jsonl."""
        record = None
        if self.rank == 0:
            with contextlib.suppress(OSError, ValueError):
                record = next((r for r in reversed(read_jsonl(self.rundir.metrics)) if r.get("step") == step), None)
        self.judge(step, record, resumed=True)

    def _verdict(self, step: int, record: dict | None, resumed: bool = False) -> dict:
        metric = self.cfg.metric
        value = record.get(metric) if record is not None and record.get("step") == step else None
        if resumed and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return {"prune": False, "why": f"rung step {step}: no {metric} in metrics.jsonl to judge again"}
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            keys = ", ".join(sorted(k for k, v in (record or {}).items() if isinstance(v, (int, float))))
            return {
                "error": f"prune.metric {metric!r} is not a number in the metrics record of rung step {step}; the "
                f"record's numbers are: {keys or 'none'}"
            }
        path = rungs_path(self.cfg, self.rundir)
        try:
            verdict = report(path, self.rundir.root.name, step, float(value), self.cfg)
        except OSError as exc:
            return {"error": f"cannot report to the sweep's rung file {path} (prune.rungs): {exc.strerror or exc}"}
        return {**asdict(verdict), "metric": metric, "rungs": str(path), "why": verdict.describe(metric)}
