"""bench/overhead.py's result: each variant's figures pooled over the rounds and set against plain's, the JSON
object, and the table printed from it."""

from __future__ import annotations

import argparse
import statistics
import time

from common import OTHER_LOAD_LIMIT  # bench/common.py (bench/ on sys.path)
from overhead_runs import RUN_CPU
from overhead_variants import PLAIN_NAMES

TARGET = 0.98


def summarize(runs: dict[str, list[dict]], tokens_per_step: int) -> dict[str, dict]:
    """Per variant (in the order of ``runs``): the median and lower-quartile step time over every round's steps,
    tokens/s, CPU seconds a step, exposed communication and its hidden share, and the ratios to plain's."""
    summary = {}
    for variant, its_runs in runs.items():
        pooled = [t for run in its_runs for t in run["steps"]]
        median, p25 = statistics.median(pooled), statistics.quantiles(pooled, n=4)[0]
        summary[variant] = {"median_step_s": median, "p25_step_s": p25, "tokens_per_s": tokens_per_step / median}
        cpu = [run[RUN_CPU] for run in its_runs if run.get(RUN_CPU) is not None]
        if cpu:  # the work a step costs, all processes together: the median over rounds
            summary[variant]["cpu_per_step_s"] = statistics.median(cpu)
        comm = [t for run in its_runs for t in run["comm"]]
        if comm:  # the trainer's exposed communication per step (not what overlapped with backward)
            summary[variant]["median_exposed_comm_s"] = statistics.median(comm)
        busy = [t for run in its_runs for t in run.get("comm_busy", [])]
        if comm and busy:  # the reduction's whole time: the share of it hidden behind backward
            summary[variant]["median_comm_busy_s"] = statistics.median(busy)
            summary[variant]["hidden_share"] = max(0.0, 1 - statistics.median(comm) / statistics.median(busy))
    plain = summary["plain"]
    for variant, s in summary.items():
        s["ratio_vs_plain"] = plain["median_step_s"] / s["median_step_s"]
        s["ratio_vs_plain_p25"] = plain["p25_step_s"] / s["p25_step_s"]
        if "cpu_per_step_s" in s and "cpu_per_step_s" in plain:
            s["cpu_ratio_vs_plain"] = plain["cpu_per_step_s"] / s["cpu_per_step_s"]
        pairs = zip(runs["plain"], runs[variant], strict=True)
        s["round_ratios"] = [p["median_step_s"] / r["median_step_s"] for p, r in pairs]
    return summary


def result_of(
    args: argparse.Namespace, overrides: list[str], runs: dict[str, list[dict]], tokens_per_step: int, started: float
) -> dict:
    """The JSON object: the set-up, the disturbed runs, the parameter counts, the summary and every run's figures."""
    disturbed = [
        f"{v} round {r['round'] + 1}" for v, rs in runs.items() for r in rs if r["other_load"] > OTHER_LOAD_LIMIT
    ]
    return {
        "benchmark": "overhead",
        "setup": {
            "config": args.config,
            "layout": args.layout,
            "overrides": overrides,
            "nodes": args.nodes,
            "ranks_per_node": args.ranks,
            "threads_per_rank": args.threads,
            "steps": args.steps,
            "skip": args.skip,
            "rounds": args.rounds,
            "tokens_per_step": tokens_per_step,
            "data": str(args.data),
            "link_mbit": args.link_mbit,
            "target_ratio": TARGET,
        },
        "disturbed_runs": disturbed,
        "n_params": {v: rs[0]["n_params"] for v, rs in runs.items() if rs[0]["n_params"] is not None},
        "summary": summarize(runs, tokens_per_step),
        "runs": {
            v: [{k: r[k] for k in ("round", "wall_s", "other_load", "median_step_s", RUN_CPU)} for r in rs]
            for v, rs in runs.items()
        },
        "wall_s": time.perf_counter() - started,
    }


def show(result: dict, grad_accum: int) -> None:
    """The table, then whether every variant trained the same parameter count and which runs were disturbed."""
    print_table(result, grad_accum)
    n_params = result["n_params"]
    if len(set(n_params.values())) > 1:
        print(f"\nwarning: the variants' models differ in parameter count ({n_params}): not the same work")
    elif n_params:
        count = next(iter(n_params.values()))
        print(f"\nparameters: {count:,} in every variant that reports them ({', '.join(n_params)})")
    if result["disturbed_runs"]:
        print(
            f"\nwarning: other processes used more than {OTHER_LOAD_LIMIT} cores during "
            f"{', '.join(result['disturbed_runs'])}: those figures are disturbed; rerun on a quiet machine."
        )


def print_table(result: dict, grad_accum: int) -> None:
    s = result["setup"]
    print(
        f"\n{s['config']}, layout {s['layout']}: {s['nodes']} node(s) x {s['ranks_per_node']} ranks, "
        f"{s['threads_per_rank']} thread(s)/rank, {s['steps']} steps (first {s['skip']} skipped), "
        f"{s['rounds']} rounds, {s['tokens_per_step']} tokens/step, "
        f"grad accumulation {grad_accum}"
        + (f", the 2 nodes joined by an emulated {s['link_mbit']:g} Mbit/s link" if s["link_mbit"] else "")
        + "\n"
        f"ratio = tokens/s / plain's ({PLAIN_NAMES[s['layout']]}; target >= {TARGET} for every trainer variant) "
        "from the median step time "
        "over all rounds;\n"
        "p25: the same from the lower-quartile step time (less hit by bursts of machine noise);\n"
        "CPU-s: CPU seconds a step costs, every process of the run together (median over rounds), and plain's / "
        "the variant's:\n  the work per step (slower at the same CPU-s: waiting; at more CPU-s: more work);\n"
        "per round: the round's median step ms / ratio of the round's medians\n"
    )
    head = f"{'variant':<18} | {'median ms':>9} | {'tokens/s':>8} | {'ratio':>5} | {'p25 ms':>6} | {'ratio':>5}"
    head += f" | {'CPU-s':>5} | {'ratio':>5}"
    print(f"{head} | {'comm ms':>7} | {'hidden':>6} | per-round ms / ratio\n" + "-" * 135)
    for variant, v in result["summary"].items():
        runs = result["runs"][variant]
        rounds = " ".join(
            f"{1e3 * r['median_step_s']:.0f}/{q:.2f}" for r, q in zip(runs, v["round_ratios"], strict=True)
        )
        comm = f"{1e3 * v['median_exposed_comm_s']:7.1f}" if "median_exposed_comm_s" in v else f"{'-':>7}"
        comm += f" | {100 * v['hidden_share']:5.0f}%" if "hidden_share" in v else f" | {'-':>6}"
        cpu = f"{v['cpu_per_step_s']:>5.3f}" if "cpu_per_step_s" in v else f"{'-':>5}"
        cpu += f" | {v['cpu_ratio_vs_plain']:>5.3f}" if "cpu_ratio_vs_plain" in v else f" | {'-':>5}"
        print(
            f"{variant:<18} | {1e3 * v['median_step_s']:>9.1f} | {v['tokens_per_s']:>8.0f} | "
            f"{v['ratio_vs_plain']:>5.3f} | {1e3 * v['p25_step_s']:>6.1f} | {v['ratio_vs_plain_p25']:>5.3f} | "
            f"{cpu} | {comm} | {rounds}"
        )
