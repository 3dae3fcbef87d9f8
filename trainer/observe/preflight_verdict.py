"""The preflight's decision (trainer/observe/preflight.py), pure: every rank's figures in, the nodes far below the
other nodes out, with the figures per node and per measured link. Every rank runs it on the same gathered
figures, so all of them act alike."""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from trainer.parallel.topology import Topology

# Figures where higher is better and a node far below the other nodes is named: (key, what it is, unit).
COMPARED = (
    ("intra_gbps", "intra-node all-reduce bandwidth", "GB/s"),
    ("link_gbps", "best inter-node link (ring ping-pong)", "GB/s"),
    ("compute_gflops", "compute", "GFLOP/s"),
    ("mem_free_gb", "free memory", "GB"),
)
# A rank's measured figures, by which of two measurements is the better one.
HIGHER_BETTER = ("mem_free_gb", "compute_gflops", "intra_gbps", "inter_gbps")
LOWER_BETTER = ("intra_latency_us", "inter_latency_us", "data_read_s")
# Rank figures summarised per node by the median of the node's ranks.
MEDIANS = (
    "mem_free_gb",
    "mem_total_gb",
    "compute_gflops",
    "intra_gbps",
    "intra_latency_us",
    "inter_gbps",
    "inter_latency_us",
)


@dataclass(frozen=True)
class Verdict:
    nodes: list[dict]  # per node: its figures (the median of its ranks'; data_read_s and seconds: the slowest rank)
    links: list[dict]  # per measured pair of neighbour nodes: {"nodes": [a, b], "gbps": x}
    named: dict[int, list[str]]  # node -> why it is named, each reason with its figures
    skipped: list[str]  # checks the job shape leaves out (they need peers it does not have)
    unreadable: str | None = None  # ranks on every node cannot read their data: the data is at fault, not a node


def _median_without(values: list[float], x: float) -> float:
    """The median of sorted ``values`` less one ``x`` (a node against the others: the others' median for each of
    512 nodes was 145 ms of sorting at 4,096 ranks). The same value as statistics.median of that list."""
    gone, k = bisect.bisect_left(values, x), len(values) - 1

    def at(j: int) -> float:
        return values[j if j < gone else j + 1]

    return at(k // 2) if k % 2 else (at(k // 2 - 1) + at(k // 2)) / 2


def judge(figures: list[dict], *, ranks_per_node: int, margin: float) -> Verdict:
    """Per-node figures and the nodes far below the others, from every rank's ``measure`` (in rank order)."""
    topo = Topology(len(figures), ranks_per_node)
    nodes = [_node_row(topo, n, [figures[r] for r in topo.node_ranks(n)]) for n in range(topo.num_nodes)]
    links = _links(figures, topo)
    best: dict[int, float] = {}  # each node's fastest link
    for link in links:
        for node in link["nodes"]:
            best[node] = max(best.get(node, link["gbps"]), link["gbps"])
    for row in nodes:
        row["link_gbps"] = best.get(row["node"])
    named = _far_below(nodes, margin)
    unreadable: dict[int, list[str]] = {}
    for f in figures:
        if f.get("data_error"):
            unreadable.setdefault(topo.node_of(f["rank"]), []).append(
                f"rank {f['rank']} cannot read its first data item: {f['data_error']}"
            )
    everywhere = None
    if len(unreadable) == topo.num_nodes:
        everywhere = unreadable[0][0]
    else:
        for node, whys in unreadable.items():
            named.setdefault(node, []).extend(whys)
    return Verdict(nodes=nodes, links=links, named=dict(sorted(named.items())), skipped=_skipped(topo),
                   unreadable=everywhere)  # fmt: skip


def _node_row(topo: Topology, n: int, mine: list[dict]) -> dict:
    """Node ``n``'s figures from its ranks': the median of each, the slowest data read and time."""
    row: dict = {"node": n, "ranks": topo.node_ranks(n), "device": mine[0].get("device")}
    for key in MEDIANS:
        row[key] = _median(f.get(key) for f in mine)
    reads = [f["data_read_s"] for f in mine if f.get("data_read_s") is not None]
    row["data_read_s"] = max(reads) if reads else None
    row["seconds"] = max(f.get("seconds", 0.0) for f in mine)
    return row


def _links(figures: list[dict], topo: Topology) -> list[dict]:
    """Each measured pair of neighbour nodes and its median speed (both ends time the same round trips)."""
    timed: dict[tuple[int, int], list[float]] = {}
    for f in figures:
        node = topo.node_of(f["rank"])
        for other, gbps in (f.get("links") or {}).items():
            timed.setdefault((min(node, int(other)), max(node, int(other))), []).append(gbps)
    return [{"nodes": list(pair), "gbps": statistics.median(v)} for pair, v in sorted(timed.items())]


def _far_below(nodes: list[dict], margin: float) -> dict[int, list[str]]:
    """The nodes whose figure of COMPARED is below (1 - margin) x the median of the other nodes', with why."""
    named: dict[int, list[str]] = {}
    for key, what, unit in COMPARED:
        values = sorted(r[key] for r in nodes if r[key] is not None)
        for row in nodes:
            if row[key] is None or len(values) < 2:
                continue
            median = _median_without(values, row[key])
            if row[key] < (1 - margin) * median:
                named.setdefault(row["node"], []).append(
                    f"{what} {fmt(row[key])} {unit} is {row[key] / median:.2f}x the median of the other nodes "
                    f"({fmt(median)} {unit})"
                )
    return named


def _skipped(topo: Topology) -> list[str]:
    """The checks the job's shape leaves out (they need peers it does not have)."""
    skipped = []
    if topo.ranks_per_node == 1:
        skipped.append("intra-node all-reduce: one rank per node")
    if topo.num_nodes == 1:
        skipped.append("inter-node all-reduce, links and the comparison of nodes: one node")
    elif topo.num_nodes == 2:
        skipped.append(
            "inter-node link ping-pong: between two nodes a slow link cannot be pinned on either end (3+ nodes); "
            "the inter-node all-reduce is reported"
        )
    return skipped


def better_of(first: dict, second: dict) -> dict:
    """One rank's figures from two measurements: the better of each measured figure (the higher bandwidth, compute
    and free memory; the lower latency and read time; per link the faster), the second's data error (a read that
    worked the second time is readable), and the time both took."""
    out = dict(second)
    for key in HIGHER_BETTER + LOWER_BETTER:
        a, b = first.get(key), second.get(key)
        if a is not None and b is not None:
            out[key] = max(a, b) if key in HIGHER_BETTER else min(a, b)
        elif a is not None:
            out[key] = a
    links = dict(first.get("links") or {})
    for other, gbps in (second.get("links") or {}).items():
        links[other] = max(gbps, links.get(other, gbps))
    out["links"] = links
    out["seconds"] = first.get("seconds", 0.0) + second.get("seconds", 0.0)
    return out


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.3g}{' ' + unit if unit else ''}"


def rounded(row: dict) -> dict:
    return {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()}
