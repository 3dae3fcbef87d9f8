"""The measured all-reduce plan (``comm.allreduce: auto``) as plain data: the figures per bucket size, the choice,
and its table. The trainer writes it (trainer/parallel/autotune.py) into the checkpoints and summary.json; the
trainer's log and ``hpc report`` print the same table from it."""

from __future__ import annotations

import math


def choose(plan: dict, nbytes: int) -> str:
    """The algorithm for a bucket of ``nbytes``: the choice at the nearest measured size (on a log scale)."""
    rows = plan["sizes"]
    if not rows:  # no bucket was seen: nothing to reduce
        return "flat"
    row = min(rows, key=lambda r: (abs(math.log(max(nbytes, 1) / r["bytes"])), r["bytes"]))
    return row["choice"]


def plan_table(plan: dict) -> list[str]:
    """A markdown table: per measured bucket size, each algorithm's time (ms) and the choice."""
    algorithms = plan["algorithms"]
    lines = [
        "| bucket | " + " | ".join(f"{a} ms" for a in algorithms) + " | chosen | vs flat |",
        "|---:|" + "---:|" * len(algorithms) + "---|---:|",
    ]
    for row in plan["sizes"]:
        ms = row["seconds"]
        cells = " | ".join("-" if ms.get(a) is None else f"{1e3 * ms[a]:.2f}" for a in algorithms)
        flat, best = ms.get("flat"), ms.get(row["choice"])
        gain = f"{flat / best:.2f}x" if flat and best else "-"
        lines.append(f"| {_size(row['bytes'])} | {cells} | {row['choice']} | {gain} |")
    return lines


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
