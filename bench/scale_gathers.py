"""bench/scale.py's gathers: what each rank sends in the collectives over every rank, and what merging N of them
costs, on synthetic per-rank inputs of the true shape (a 4,096-rank launch is not started for them). The package's
own merge functions run on them; ``Gathered`` hands a function the N contributions as its collective would."""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
import statistics
import time
from pathlib import Path

import torch
from scale_ranks import make_env  # bench/ is on sys.path

from runconfig.layout import Layout
from rundir.checkpoints import manifest_digest
from rundir.identity import RunIdentity, seal_manifest
from storage.ioretry import RetryPolicy
from trainer.checkpoint.agreement import Agreement
from trainer.checkpoint.fingerprint import owners_among
from trainer.checkpoint.reader import shares
from trainer.observe.preflight_verdict import judge
from trainer.observe.record import gather_launch_record
from trainer.observe.replicas import verdict

PER_NODE = 8
GPT2_PARAMS = 148  # named parameters of a 12-layer GPT (a rank's list for the fingerprint)


class Gathered:
    """The N ranks' contributions, as mpi4py's ``gather`` hands them to rank 0 (a fresh copy each call)."""

    def __init__(self, values: list) -> None:
        self.values = values

    def gather(self, mine, root: int = 0) -> list:
        return copy.deepcopy(self.values)


class Agreed(Agreement):
    """A checkpoint agreement whose all_gather hands back the N ranks' contributions."""

    def __init__(self, values: list) -> None:
        super().__init__(0, len(values), None, RetryPolicy(retries=0, backoff_s=0.0, setting="-"))
        self.values = values

    def gather(self, value) -> list:  # noqa: ANN001
        return self.values


def sha(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def ms(fn, reps: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs."""
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(1e3 * statistics.median(times), 3)


def payload(values: list, protocol: int) -> dict:
    sizes = [len(pickle.dumps(v, protocol=protocol)) for v in values]
    return {"bytes_per_rank_max": max(sizes), "bytes_in_all": sum(sizes)}


def checkpoint(n: int) -> dict:
    """A save's agreement (every rank's files, gathered to every rank), rank 0's manifest, a restore's share."""
    files = [{f"dcp/__{r}_0.distcp": {"size": 1_234_567_890 + r, "sha256": sha("dcp", r)},
              f"rank_{r:05d}.pt": {"size": 16_811, "sha256": sha("rng", r)}} for r in range(n)]  # fmt: skip
    contributions = [(None, 12.3 + r * 1e-3, f) for r, f in enumerate(files)]  # agreement.py's (report, s, files)
    merged = {k: v for part in files for k, v in part.items()}
    identity = RunIdentity("r" * 32, b"k" * 32)

    def commit() -> str:
        manifest = seal_manifest({"format": 3, "step": 120_000, "world_size": n, "files": merged}, identity)
        manifest["manifest_sha256"] = manifest_digest(manifest)
        return json.dumps(manifest, indent=2)

    agreement = Agreed(contributions)

    def agree() -> dict:  # every rank, at each save (trainer/checkpoint/writer.py)
        return {k: v for part in agreement.agree(None, time.monotonic(), payload=files[0]) for k, v in part.items()}

    sizes = {name: int(meta["size"]) for name, meta in merged.items()}
    return {"agreement": {**payload(contributions, 4), "merge_ms": ms(agree)},
            "manifest": {"json_bytes": len(commit()), "commit_ms": ms(commit)},
            "restore_shares_ms": ms(lambda: shares(sizes, n))}  # fmt: skip


def fingerprint(n: int) -> dict:
    """A digest of each rank's parameter list (one list a distinct digest follows), and the owners of the
    parameters among the ranks that hold them."""
    names = {f"blocks.{i // 12}.p{i % 12}": 768 * 768 + i for i in range(GPT2_PARAMS)}
    holders = dict.fromkeys(names, list(range(n)))  # every rank holds every name (DDP, FSDP): one list
    digests = [sha(sorted(names.items()))] * n
    return {**payload(digests, 4), "owners_ms": ms(lambda: owners_among(sorted(names), names, holders))}


def replicas(n: int) -> dict:
    env, digests = make_env(0, n, PER_NODE, Path("/tmp")), ["0123456789abcdef01234567"] * n
    digests[n // 2] = "fedcba9876543210fedcba98"
    return {**payload(digests, 4), "verdict_ms": ms(lambda: verdict(digests, Layout(dp_replicate=n), env, 100))}


def preflight(n: int) -> dict:
    nodes = n // PER_NODE

    def figure(r: int) -> dict:
        node = r // PER_NODE
        links = {} if nodes < 3 else {(node - 1) % nodes: 22.1 + 0.01 * r, (node + 1) % nodes: 22.3}
        return {"rank": r, "device": "NVIDIA H100 80GB HBM3", "mem_free_gb": 84.1, "mem_total_gb": 85.0,
                "data_read_s": 0.0021, "data_error": None, "compute_gflops": 7.1e5 + r, "intra_gbps": 361.2,
                "intra_latency_us": 21.3, "inter_gbps": 41.9, "inter_latency_us": 61.0, "links": links,
                "seconds": 3.21}  # fmt: skip

    figures = [figure(r) for r in range(n)]
    return {**payload(figures, 5), "judge_ms": ms(lambda: judge(figures, ranks_per_node=PER_NODE, margin=0.5))}


def launch_record(n: int) -> dict:
    env = make_env(0, n, PER_NODE, Path("/tmp"))
    facts = [{"rank": r, "node": env.node_names[r], "host": f"gpu{r // PER_NODE:05d}", "cpu": "Xeon 8480+",
              "cpus_per_rank": 14, "memory_kb": 2_113_646_240, "kernel": "5.14.0-427.el9.x86_64",
              "gpu": {"name": "NVIDIA H100 80GB HBM3", "memory_mb": 81_559, "capability": "9.0"}}
             for r in range(n)]  # fmt: skip
    gathered = Gathered(facts)
    record = gather_launch_record(env, torch.device("cpu"), gathered)
    return {**payload(facts, 5), "merge_ms": ms(lambda: gather_launch_record(env, torch.device("cpu"), gathered)),
            "json_bytes": len(json.dumps(record, indent=1, sort_keys=True, default=str))}  # fmt: skip


def measure(n: int) -> dict:
    """Every gather's payload and merge at ``n`` ranks."""
    return {
        "checkpoint": checkpoint(n),
        "fingerprint": fingerprint(n),
        "replicas": replicas(n),
        "preflight": preflight(n),
        "launch_record": launch_record(n),
        "stragglers": {"bytes_per_rank_max": 8, "bytes_in_all": 8 * n},  # one float64 a rank, all_gather
        "allreduce_plan": {"bytes_per_rank_max": 48, "bytes_in_all": 48},
    }  # an all_reduce of 6 float64
