"""Straggler detection: every N steps the ranks compare how long they were busy per step.

A rank's busy time is its step time minus the time it waited in collectives (exposed communication and the
per-step metric all-reduce): all ranks leave a synchronous step together, so step time alone cannot tell who
held the others up. Each rank contributes the median of its busy times since the last check (one all-gather of
one number per rank); a rank, or a node (median of its ranks), busier than the median by more than
``monitor.straggler_margin`` is a straggler, logged with its host and counted in the summary. A node that is a
straggler in ``monitor.straggler_exclude_after`` checks in a row is to be left out (``evict``): every rank sees the
same gathered figures, so every rank reaches that verdict at the same step.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter

import torch
import torch.distributed as dist

from runconfig.schema import MonitorConfig
from trainer.env import RuntimeEnv

log = logging.getLogger(__name__)


class NodeEvicted(Exception):
    """Raised on every rank at the same step, after a committed checkpoint: a node lagged behind in
    monitor.straggler_exclude_after checks in a row (``info``: its figures) and the launch ends to leave it out."""

    def __init__(self, info: dict) -> None:
        super().__init__(f"node {info['node']} lagged behind")
        self.info = info


class StragglerCheck:
    def __init__(self, env: RuntimeEnv, cfg: MonitorConfig, device: torch.device) -> None:
        self.env, self.cfg, self.device = env, cfg, device
        self._busy: list[float] = []
        self.rank_counts: Counter[int] = Counter()
        self.node_counts: Counter[int] = Counter()
        self.streak: Counter[int] = Counter()  # checks in a row each node was a straggler

    def add(self, busy_s: float) -> None:
        self._busy.append(busy_s)

    def due(self, step: int) -> bool:
        every = self.cfg.straggler_every
        return bool(every) and self.env.world_size > 1 and step % every == 0 and bool(self._busy)

    def check(self, step: int) -> dict:
        """Collective (every rank calls it at the same step): the per-rank medians and the stragglers."""
        mine = torch.tensor([statistics.median(self._busy)], dtype=torch.float64, device=self.device)
        self._busy = []
        gathered = [torch.zeros_like(mine) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, mine)
        times = [float(t.item()) for t in gathered]
        median = statistics.median(times)
        limit = median * (1 + self.cfg.straggler_margin)
        topo = self.env.topology
        stragglers = []
        for rank, t in enumerate(times):
            if t > limit:
                self.rank_counts[rank] += 1
                stragglers.append(
                    {
                        "rank": rank,
                        "host": self.env.hosts[rank],
                        "node": topo.node_of(rank),
                        "step_time_s": t,
                        "ratio": t / median if median > 0 else float("inf"),
                    }
                )
        slow_nodes = []
        if topo.num_nodes > 1:
            node_times = [statistics.median(times[r] for r in topo.node_ranks(n)) for n in range(topo.num_nodes)]
            node_median = statistics.median(node_times)
            for node, t in enumerate(node_times):
                if t > node_median * (1 + self.cfg.straggler_margin):
                    self.node_counts[node] += 1
                    host = self.env.hosts[topo.node_ranks(node)[0]]
                    ratio = t / node_median if node_median > 0 else float("inf")
                    slow_nodes.append({"node": node, "host": host, "step_time_s": t, "ratio": ratio})
        flagged = {n["node"] for n in slow_nodes}
        for node in range(topo.num_nodes):
            self.streak[node] = self.streak[node] + 1 if node in flagged else 0
        evict = None
        after = self.cfg.straggler_exclude_after
        for n in slow_nodes:
            if after and self.streak[n["node"]] >= after:
                evict = {**n, "checks": self.streak[n["node"]], "ranks": topo.node_ranks(n["node"])}
                break
        if self.env.rank == 0:
            first = step - self.cfg.straggler_every + 1
            for s in stragglers:
                log.warning(
                    "straggler: rank %d (host %s, node %d) busy %.3f s/step, %.2fx the median %.3f s (steps %d..%d)",
                    s["rank"], s["host"], s["node"], s["step_time_s"], s["ratio"], median, first, step,
                )  # fmt: skip
            for n in slow_nodes:
                log.warning(
                    "straggler node %d (host %s): busy %.3f s/step, %.2fx the median node",
                    n["node"], n["host"], n["step_time_s"], n["ratio"],
                )  # fmt: skip
        out = {"rank_step_time_s": times, "stragglers": stragglers, "straggler_nodes": slow_nodes}
        if evict is not None:
            out["evict"] = evict
        return out

    def summary(self) -> dict:
        return {
            "straggler_checks_flagged": {str(r): c for r, c in sorted(self.rank_counts.items())},
            "straggler_nodes_flagged": {str(n): c for n, c in sorted(self.node_counts.items())},
        }
