"""Who received a stop signal and what a stop costs, measured by the trainer on every run (the records and the
lead-time rule are rundir/stopsignal.py's):

- ``record_signal_path`` (every rank, at start): how a signal reaches this rank, in its node's
  logs/signal_node_NNNNN.json. A stop signal blocked since the process started is a warning: the rank cannot stop on
  it.
- ``StopTimes`` (the loop's clock readings at a stop) and ``stopped_fields`` (every rank, once the stop's
  checkpoint is committed: one allgather of each rank's signal and arrival time): the stopped event's figures, and
  one log line per rank saying whether it received the signal itself.
- ``LeadCheck`` (rank 0, after each checkpoint save): whether job.signal_lead_s covers a step and the save with
  margin, written to stop_budget.json once per launch and again, with a warning, when it first falls short.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from dataclasses import dataclass

from mpi4py import MPI

from rundir import RunDir
from rundir.stopsignal import (
    LeadBudget,
    describe_process,
    estimate,
    process_chain,
    signal_name,
)
from storage.files import write_json_atomic
from trainer.env import RuntimeEnv, patient_allgather
from trainer.loop.stop import EarlySignals, StopFlag

log = logging.getLogger(__name__)


def record_signal_path(
    rundir: RunDir, env: RuntimeEnv, names: list[str], early: EarlySignals | None, comm: MPI.Comm
) -> dict:
    """This rank's signal record (its process chain, the stop signals blocked in it or ignored when it started),
    with a warning about a blocked one; the node's first rank writes its node's records in one file (collective
    over the node's ranks). Never fails the run: a record that cannot be written is left out."""
    blocked_now = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # adds nothing: reads the mask
    numbers = {name: signal.Signals[name] for name in names}
    installed = early.installed if early is not None else {}
    record = {
        "rank": env.rank,
        "world_size": env.world_size,
        "host": env.hostname,
        "slurm_node": env.slurm_node,
        "launch": env.launch_id,
        "time": time.time(),
        "stop_signals": names,
        "blocked": [name for name, n in numbers.items() if n in blocked_now],
        "ignored_at_start": [name for name, n in numbers.items() if installed.get(n) is signal.SIG_IGN],
        "chain": process_chain(names),
    }
    if record["blocked"]:
        parent = describe_process(record["chain"][1]) if len(record["chain"]) > 1 else "its launcher"
        log.warning(
            "%s blocked in this rank since its process started (inherited from its parent, %s): the rank cannot "
            "stop on %s. Check the signal path with: python -m hpc selftest CONFIG",
            " and ".join(record["blocked"]),
            parent,
            "it" if len(record["blocked"]) == 1 else "them",
        )
    node_comm = comm.Split(env.node, env.rank)
    records = node_comm.gather(record, root=0)
    if node_comm.rank == 0:
        with contextlib.suppress(OSError):
            write_json_atomic(rundir.signal_record(env.node), {"node": env.node, "records": records})
    node_comm.Free()
    return record


@dataclass(frozen=True)
class StopTimes:
    """This rank's clock (time.time()) at a stop: the boundary agreement, the final save's start, its commit."""

    agreed: float
    save_start: float
    committed: float


def stopped_fields(comm: MPI.Comm, env: RuntimeEnv, stop: StopFlag, times: StopTimes, lead_s: float) -> dict:
    """Collective, once per stop, after its checkpoint is committed (so a signal that lands during the save still
    counts as received): the stopped event's fields (used on rank 0), and each rank's log line on its receipt.

    The first arrival is the earliest over the ranks' clocks (hosts' clocks agree to NTP's precision); an arrival is
    when the rank's Python handler ran, which a long C call (a collective) can delay after the kernel's delivery."""
    if stop.signum is not None and stop.at is not None:
        log.info(
            "stop: this rank received %s itself, %.2f s before the ranks agreed to stop",
            signal_name(stop.signum),
            times.agreed - stop.at,
        )
    else:
        log.info("stop: this rank received no stop signal itself; it stopped because the other ranks agreed to")
    arrivals = patient_allgather(comm, (stop.signum, stop.at))  # the ranks come from the stop's save at different times
    received: dict[str, list[int]] = {}
    for rank, (signum, _) in enumerate(arrivals):
        if signum is not None:
            received.setdefault(signal_name(signum), []).append(rank)
    got = sorted((at, signum) for signum, at in arrivals if signum is not None and at is not None)
    fields: dict = {
        "signal": got[0][1] if got else stop.signum,  # the first signal a rank got: it says why
        "received": received,
        "learned": [rank for rank, (signum, _) in enumerate(arrivals) if signum is None],
        "save_s": round(times.committed - times.save_start, 3),
        "lead_s": lead_s,
    }
    if got:
        first = got[0][0]
        fields["stop_s"] = round(max(0.0, times.agreed - first), 3)
        fields["signal_to_commit_s"] = round(max(0.0, times.committed - first), 3)
        fields["arrival_spread_s"] = round(got[-1][0] - first, 3)
        if env.rank == 0:
            budget = LeadBudget(lead_s=lead_s, needed_s=fields["signal_to_commit_s"], measured=True)
            (log.info if budget.ok else log.warning)(
                "stop: %d of %d ranks received the signal themselves; %.2f s to agree at a step boundary, %.2f s "
                "to save; %s",
                len(arrivals) - len(fields["learned"]),
                len(arrivals),
                fields["stop_s"],
                fields["save_s"],
                budget.describe(),
            )
    return fields


class LeadCheck:
    """Rank 0, once per launch: does ``job.signal_lead_s`` cover a stop (a step, then the final save) with margin?
    Estimated after each checkpoint save from the step's time and the newest save's; recorded the first time, and
    again with a warning the first time it falls short."""

    def __init__(self, lead_s: float, rundir: RunDir, env: RuntimeEnv) -> None:
        self.lead_s, self.rundir, self.env = lead_s, rundir, env
        self.recorded = self.warned = False

    def after_save(self, step: int, step_s: float, save_s: float | None) -> LeadBudget | None:
        if self.env.rank != 0 or save_s is None or self.warned:
            return None
        budget = estimate(self.lead_s, step_s, save_s)
        if self.recorded and budget.ok:
            return budget
        record = {**budget.fields(), "step_s": round(step_s, 3), "save_s": round(save_s, 3), "step": step}
        with contextlib.suppress(OSError):  # a full disk must not end the run over this file
            write_json_atomic(self.rundir.stop_budget, {**record, "launch": self.env.launch_id, "time": time.time()})
        self.recorded = True
        if not budget.ok:
            self.warned = True
            log.warning("%s (estimated at step %d)", budget.describe(), step)
        return budget
