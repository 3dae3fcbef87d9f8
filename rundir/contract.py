"""The run directory's contract, defined once: exit statuses, history events, environment variables, step-time
parts (the two ways its files are written, JSON lines appended and JSON replaced atomically: storage/files.py).

Torch-free: the login-node side (``hpc``), the sbatch scripts (through ``python -m``), the trainer and the tests
import these names; a literal that names one of them anywhere else is a bug waiting for a rename.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from storage.files import append_jsonl

# -- exit statuses (of the trainer, the launchers and the CLI) ----------------------------------------------------
EXIT_DONE = 0  # training complete
EXIT_FAILED = 1  # the launch failed (a bug, a rank gone): restarted in the job up to job.max_failures, never requeued
EXIT_USER_ERROR = 2  # bad input: one message naming the file, key or rank; nothing lost
EXIT_HANG = 3  # the hang watchdog ended the job (ranks named in failure.json)
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal at a step boundary, checkpoint committed, resumable
EXIT_LEAD_SHORT = 4  # `python -m hpc selftest`: every rank got the signal, but job.signal_lead_s is too short

# -- history.jsonl events (one JSON object per line, each with "event", "time" and the "launch" that wrote it) ----
EVENT_START = "start"  # a launch began training from step 0
EVENT_RESUME = "resume"  # a launch restored a checkpoint
EVENT_STOPPED = "stopped"  # stopped by a signal with a committed checkpoint
EVENT_DONE = "done"  # training complete, summary.json written
EVENT_SPIKE = "spike"  # a loss spike: its step, loss, the median it exceeded and what was done (train.spike_*)
EVENT_PRUNED = "pruned"  # a sweep element stopped at a rung (prune.*), its checkpoint committed: ended for good
EVENT_HANG = "hang"  # the hang watchdog ended the job
EVENT_CODE = "code"  # the recipe's code snapshot was taken or refreshed (login node)
EVENT_RESTART = "restart"  # a launch failed (not the user's fault): the launcher restarts the ranks in the job
EVENT_REJOIN = "rejoin"  # a rank died and the others went on in the same processes, a spare in its place
EVENT_BAD_NODE = "bad_node"  # a node a failure pointed at, with the evidence: no later launch of the run uses it
EVENT_NODE_BACK = "node_back"  # a bad node taken back (by hand, or after job.retake_nodes_after_s): launches use it
EVENT_PREFLIGHT = "preflight"  # the gang preflight's figures before step 0 (trainer/observe/preflight.py)

# -- failure.json "kind": what the trainer diagnosed when a launch failed --------------------------------------------
FAILURE_USER = "user_error"  # bad input: never retried
FAILURE_HANG = "hang"  # the hang watchdog ended the ranks
FAILURE_CRASH = "failed"  # a collective failed, a rank went away, a bug
FAILURE_STRAGGLER = "straggler"  # a node slower than its peers in monitor.straggler_exclude_after checks in a row
FAILURE_CORRUPT = "corrupt"  # data-parallel replicas' weights differ (monitor.replica_check_every; suspects name it)
FAILURE_SPIKE = "spike"  # a loss spike (train.spike_factor) rolled back: restart from before it, its data skipped
FAILURE_PREFLIGHT = "preflight"  # the gang preflight before step 0 found a node unfit (suspects name it)

# -- environment variables from the launchers to the ranks -----------------------------------------------------
LAUNCH_VAR = "HPC_LAUNCH_ID"  # this start of the ranks, written into every history event
SIMULATE_VAR = "HPC_SIMULATE_RANKS_PER_NODE"  # lay one host's ranks out as simulated nodes of this many ranks
DATA_CACHE_VAR = "HPC_DATA_CACHE"  # datasets prepared on first use (default ~/.cache/hpc-trainer/data)
NODE_LABELS_VAR = "HPC_NODE_LABELS"  # simulated nodes' names, comma-separated in node order (local launcher)
INJECT_VAR = "HPC_INJECT"  # faults injected on purpose by tests (trainer/observe/inject.py)
# With job.spare_ranks, the launch's keeper (trainer/parallel/keeper.py): "ADDR:STORE_PORT:LIVE_PORT", and the
# launch's store key (hex; made by the launcher, never written to a file; the ranks drop it from their environment)
KEEPER_VAR = "HPC_KEEPER"
STORE_KEY_VAR = "HPC_STORE_KEY"
# With job.spare_ranks the local launcher starts the ranks itself (hpc/spawn.py), not through MPI: each one's rank
# and the world size
SPAWN_RANK_VAR = "HPC_SPAWN_RANK"
SPAWN_WORLD_VAR = "HPC_SPAWN_WORLD"
# Read by the local launcher (hpc/local.py): one command prefix per simulated node, "|"-separated (benchmarks run
# each emulated node's ranks in a network namespace of its own: `ip netns exec NAME`)
NODE_WRAP_VAR = "HPC_LOCAL_NODE_WRAP"

# -- step-time parts: metrics.jsonl has time_<part>_s for each ----------------------------------------------------
PARTS = ("data", "compute", "comm", "optim", "ckpt", "sync")
PART_KEYS = tuple(f"time_{p}_s" for p in PARTS)


def append_event(path: Path, event: str, **fields) -> None:
    """One line in a run's history.jsonl: the event name, the time, then ``fields``."""
    append_jsonl(path, {"event": event, "time": time.time(), **fields})


def launches_and_restarts(events: list[dict]) -> tuple[int, int]:
    """In a run's history events: its launches so far (start and resume events) and its in-job restarts."""
    launches = sum(1 for e in events if e.get("event") in (EVENT_START, EVENT_RESUME))
    return launches, sum(1 for e in events if e.get("event") == EVENT_RESTART)


def data_cache(environ: Mapping[str, str]) -> Path:
    """Where datasets prepared on first use are kept: $HPC_DATA_CACHE, else ~/.cache/hpc-trainer/data."""
    return Path(environ.get(DATA_CACHE_VAR) or Path.home() / ".cache" / "hpc-trainer" / "data")


def rank_ranges(ranks: list[int]) -> str:
    """How a record's text names ranks: [0, 1, 2, 5] -> '0-2,5' (2,048 waiting ranks are one range, not 12 KB)."""
    out, ranks = [], sorted(set(ranks))
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)
