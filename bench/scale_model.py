"""bench/scale.py's figures beyond this machine: each fitted to a linear (alpha-beta) model in N and carried on.

    python bench/scale_model.py SCALE_JSON [--to 8192 16384] [--png PATH] [--json PATH]

Each quantity is fitted, by least squares over the measured world sizes, as alpha + beta x N: a fixed cost plus a
cost per rank (rank 0 reads one heartbeat a rank an interval, serves three connections a rank, and a roll call or a
claim writes one key a rank and reads them 256 at a time). Assumptions: the store's server is one thread whose
cost per operation does not grow with N (its map is a hash table; measured p50 0.06-0.14 ms from 64 to 4,096);
every rank has its own CPU (on this 2-core machine the simulated ranks share two, which inflates the roll call's and
the claim's times, so the model is an upper bound there); the network adds its round trip per operation, which a
loopback store does not see (alpha grows by it on a cluster, beta by N/256 round trips for a read of every key).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common import bench_parser, emit  # bench/ is on sys.path

# (name, how to read it from a row of bench/scale.py, unit)
QUANTITIES = (
    ("rank0_cpu_pct", lambda r: 100 * r["rank0"]["cpu_share"], "% of a core"),
    ("rank0_rss_mb", lambda r: r["rank0"]["rss_mb"], "MB"),
    ("rank0_sockets", lambda r: r["rank0"]["sockets"], ""),
    ("store_ops_per_s", lambda r: r["store_ops_per_s"], "/s"),
    ("roll_call_s", lambda r: r["roll_call"]["s"], "s"),
    ("claim_seen_s", lambda r: r["claim_seen"]["by_all_live_s"], "s"),
)


def parse_args(argv: list[str] | None):
    p = bench_parser(__doc__)
    p.add_argument("scale_json", type=Path, help="what bench/scale.py --json wrote")
    p.add_argument("--to", type=int, nargs="+", default=[8192, 16384], help="world sizes to carry the model to")
    p.add_argument("--png", type=Path, help="draw the measured points and the model's lines into this PNG")
    return p.parse_args(argv)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(alpha, beta) of the least-squares line ys = alpha + beta x xs."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if n > 1 and sxx else 0.0
    return my - beta * mx, beta


def model(rows: list[dict], to: list[int]) -> dict:
    ranks = [r["ranks"] for r in rows]
    out = {}
    for name, read, unit in QUANTITIES:
        measured = [read(r) for r in rows]
        if any(v is None for v in measured):
            continue
        alpha, beta = fit(ranks, measured)
        out[name] = {
            "unit": unit,
            "alpha": alpha,
            "beta_per_rank": beta,
            "measured": dict(zip(map(str, ranks), measured, strict=True)),
            "model": {str(n): round(alpha + beta * n, 4) for n in [*ranks, *to]},
        }
    return out


def draw(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6))
    FigureCanvasAgg(fig)
    names = list(result["model"])
    for i, name in enumerate(names):
        q = result["model"][name]
        ax = fig.add_subplot(2, (len(names) + 1) // 2, i + 1)
        xs = [int(n) for n in q["model"]]
        ax.plot(xs, list(q["model"].values()), "-", label="model")
        ax.plot([int(n) for n in q["measured"]], list(q["measured"].values()), "o", label="measured")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{name} ({q['unit']})" if q["unit"] else name, fontsize=9)
        ax.tick_params(labelsize=7)
    fig.axes[0].legend(fontsize=7)
    fig.suptitle(f"bench/scale.py, {result['source']}: measured to {max(result['measured_ranks'])} ranks, "
                 f"modelled to {max(result['to'])}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def show(result: dict) -> None:
    sizes = [*map(str, result["measured_ranks"]), *map(str, result["to"])]
    print(f"{'quantity':>18} {'alpha':>10} {'beta/rank':>12} " + " ".join(f"{s:>10}" for s in sizes))
    for name, q in result["model"].items():
        cells = " ".join(f"{q['model'][s]:>10.4g}" for s in sizes)
        print(f"{name:>18} {q['alpha']:>10.4g} {q['beta_per_rank']:>12.4g} {cells}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = json.loads(args.scale_json.read_text())["rows"]
    if len(rows) < 2:
        sys.exit(f"error: {args.scale_json} holds {len(rows)} world size(s); the model needs at least 2")
    result = {"benchmark": "scale_model", "source": args.scale_json.name, "measured_ranks": [r["ranks"] for r in rows],
              "to": args.to, "model": model(rows, args.to)}  # fmt: skip
    if args.png is not None:
        draw(result, args.png)
        result["png"] = str(args.png)
    emit(result, args.json, show)


if __name__ == "__main__":
    main()
