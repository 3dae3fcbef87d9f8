"""bench/checkpoint.py's result (rank 0): the figures, targets and phases from the repetitions' samples, and the
tables printed from them."""

from __future__ import annotations

import statistics
from pathlib import Path

from common import emit  # bench/common.py (on sys.path)

MEASURES = ("raw", "sync", "async", "restore", "step")
TARGET_SAVE_OVER_RAW = 0.5
TARGET_ASYNC_BLOCKING = 0.1
PHASE_COLUMNS = ("sync", "async", "restore")


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


def report(setup: dict, samples: dict[str, list[dict]], json_path: Path | None) -> None:
    """Print the tables and the JSON object of the samples (per measure, one dict per repetition: the slowest
    rank's ``seconds``, ``blocking_s`` for a save, rank 0's ``phases``); with ``json_path`` write it there too."""
    results = figures(setup["checkpoint_bytes"], samples)
    result = {
        "benchmark": "checkpoint",
        "setup": setup,
        "units": {"time": "s", "bw": "GB/s (1e9 bytes)"},
        "results": results,
        "targets": targets(results),
        "phases_median_s": phase_medians(samples),
        "phases_other_s": unwrapped(samples),
    }
    emit(result, json_path, show)


def figures(nbytes: int, samples: dict[str, list[dict]]) -> dict:
    """Each measure's seconds (median, min, max, samples), the throughputs and the ratios."""
    t = {m: summarize([s["seconds"] for s in samples[m]]) for m in MEASURES}
    t["async_blocking"] = summarize([s["blocking_s"] for s in samples["async"]])
    t["sync_blocking"] = summarize([s["blocking_s"] for s in samples["sync"]])
    med = {k: v["median"] for k, v in t.items()}
    gbps = {k: nbytes / med[k] / 1e9 for k in ("raw", "sync", "async", "restore")}
    return {
        "raw_write_s": t["raw"],
        "raw_write_GBps": gbps["raw"],
        "sync_save_s": t["sync"],
        "sync_save_GBps": gbps["sync"],
        "save_over_raw": gbps["sync"] / gbps["raw"],
        "sync_blocking_s": t["sync_blocking"],
        "async_blocking_s": t["async_blocking"],
        "async_blocking_over_sync_save": med["async_blocking"] / med["sync"],
        "async_blocking_over_step": med["async_blocking"] / med["step"],
        "sync_blocking_over_step": med["sync"] / med["step"],
        "async_total_s": t["async"],
        "async_total_GBps": gbps["async"],
        "restore_s": t["restore"],
        "restore_GBps": gbps["restore"],
        "step_s": t["step"],
    }


def targets(results: dict) -> dict:
    return {
        "save_over_raw": {
            "target": f">= {TARGET_SAVE_OVER_RAW}",
            "met": results["save_over_raw"] >= TARGET_SAVE_OVER_RAW,
        },
        "async_blocking_over_sync_save": {
            "target": f"<= {TARGET_ASYNC_BLOCKING}",
            "met": results["async_blocking_over_sync_save"] <= TARGET_ASYNC_BLOCKING,
        },
    }


def phase_medians(samples: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per save/restore column, each wrapped phase's median seconds (rank 0)."""
    phases: dict[str, dict[str, float]] = {}
    for col in PHASE_COLUMNS:
        keys = sorted({k for s in samples[col] for k in s["phases"]})
        phases[col] = {k: statistics.median([s["phases"].get(k, 0.0) for s in samples[col]]) for k in keys}
    return phases


def unwrapped(samples: dict[str, list[dict]]) -> dict[str, float]:
    """Per column, the median of the measured time minus the wrapped phases (foreground only for async)."""
    return {
        c: statistics.median(
            s["blocking_s" if c == "async" else "seconds"]
            - sum(v for k, v in s["phases"].items() if not k.startswith("bg:"))
            for s in samples[c]
        )
        for c in PHASE_COLUMNS
    }


def show(result: dict) -> None:
    """The tables: the set-up, every measure, where the time goes."""
    print_heading(result["setup"])
    print_measures(result["setup"], result["results"])
    print_phases(result["phases_median_s"], result["phases_other_s"])


def print_heading(setup: dict) -> None:
    model, where, load = setup["model"], setup["dir"], setup["loadavg_1min_before_after"]
    print(
        f"\ncheckpoint benchmark: GPT d_model={model['d_model']} n_layers={model['n_layers']} "
        f"({model['params'] / 1e6:.1f}M params) -> {setup['checkpoint_bytes'] / 1e6:.1f} MB in "
        f"{setup['checkpoint_files']} files (model + AdamW moments)\nworld {setup['world_size']}, "
        f"{setup['threads_per_rank']} torch threads/rank, {setup['cpus']} cpus; folder {where['path']} "
        f"({where['fstype']} on {where['device']}, same filesystem as repo: {where['same_filesystem_as_repo']})\n"
        f"{setup['reps']} reps (+{setup['warmup_reps']} warm-up), interleaved; medians (min..max); GB = 1e9 bytes; "
        f"1-min load average before/after {load[0]:.1f}/{load[1]:.1f}\n"
    )


def print_measures(setup: dict, r: dict) -> None:
    rows = [  # label, the seconds' key, the throughput's key, note
        ("raw write + fsync", "raw_write_s", "raw_write_GBps", ""),
        (
            "sync save (block=True)",
            "sync_save_s",
            "sync_save_GBps",
            f"save/raw = {r['save_over_raw']:.2f} (target >= 0.5); blocks {r['sync_blocking_over_step']:.2f} steps",
        ),
        (
            "async save: blocked",
            "async_blocking_s",
            None,
            f"{r['async_blocking_over_sync_save']:.1%} of sync save (target <= 10%); "
            f"blocks {r['async_blocking_over_step']:.2f} steps",
        ),
        ("async save: total", "async_total_s", "async_total_GBps", "save() + wait() until committed"),
        ("restore (newest)", "restore_s", "restore_GBps", "SHA-256 verify + DCP load + set_state_dict"),
        (
            "train step",
            "step_s",
            None,
            f"forward + backward + AdamW, {setup['batch_per_rank']} x {setup['seq_len']} tokens/rank",
        ),
    ]
    print(f"{'measure':<24} {'seconds':>8} {'(min..max)':>16} {'GB/s':>7}  note\n" + "-" * 100)
    for label, key, bw_key, note in rows:
        spread = f"({r[key]['min']:.3f}..{r[key]['max']:.3f})"
        bw_text = f"{r[bw_key]:7.3f}" if bw_key is not None else " " * 7
        print(f"{label:<24} {r[key]['median']:8.3f} {spread:>16} {bw_text}  {note}")


def print_phases(phases: dict[str, dict[str, float]], other: dict[str, float]) -> None:
    all_phases = sorted({k for col in phases.values() for k in col}, key=lambda k: (k.startswith("bg:"), k))
    print("\nwhere the time goes (rank 0, median seconds per save/restore; bg: = background thread)")
    print(f"{'phase':<24} " + " ".join(f"{c:>9}" for c in PHASE_COLUMNS) + "\n" + "-" * 56)
    for k in all_phases:
        print(
            f"{k:<24} "
            + " ".join(f"{phases[c].get(k, 0.0):9.3f}" if k in phases[c] else f"{'':>9}" for c in PHASE_COLUMNS)
        )
    print(f"{'other (unwrapped)':<24} " + " ".join(f"{other[c]:9.3f}" for c in PHASE_COLUMNS))
    print("(async column: foreground phases add up to the blocked time; bg: phases run after save() returned)")
