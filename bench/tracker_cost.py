"""What experiment tracking costs a step: the same run with tracking off, to the embedded MLflow store (SQLite
beside the run directory), to a real `mlflow server` (envs/mlflow/server.sh on a local port), and with live metrics
(tracking off, ``live.serve`` scraped every second by a real Prometheus and pushes every second to a real
Pushgateway: envs/prometheus/server.sh), side by side.

Each round runs the three variants one after the other (``python -m hpc.submit tiny --local``, N simulated nodes x
R ranks, every step logged, a checkpoint every ``--ckpt-every`` steps, which is when the tracker is sent the steps
it covers), in a rotated order, so that machine noise hits every variant alike. The figures are the median and the
mean of ``step_time_s`` over the steps after ``--skip`` of all rounds: the mean counts the steps after a commit,
while the tracker sends. The tracker's client is imported and its store made in rank 0's background thread during
start-up and the first steps: that one-off cost shows in the run's wall time, also reported. The tracker's history
is read back after each tracked run: every step once. The server shares this host's cores with the ranks (on a
cluster it runs elsewhere). Prints a table and a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (  # bench/ on sys.path
    ROOT,
    add_nodes_ranks,
    add_run_length,
    bench_parser,
    check_run_length,
    emit,
    lines,
)

VARIANTS = ("off", "embedded", "server", "live")
TRACKED = ("embedded", "server")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__, prog="python bench/tracker_cost.py")
    add_run_length(p, steps=300, skip=60, rounds=3, of="variant")
    p.add_argument("--ckpt-every", type=int, default=50)
    add_nodes_ranks(p, nodes=1, ranks=2)
    p.add_argument("--set", action="append", default=[], help="more config overrides (KEY=VALUE)")
    p.add_argument("--work", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="a subset, comma-separated (off is always run)")
    args = p.parse_args(argv)
    check_run_length(p, args)
    args.variants = tuple(v for v in VARIANTS if v == "off" or v in args.variants.split(","))
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_script(verb: str, state: Path, port: int) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "HPC_MLFLOW_PORT": str(port)}
    subprocess.run(["bash", str(ROOT / "envs/mlflow/server.sh"), verb, str(state)], check=True, env=env)


def prometheus_script(verb: str, state: Path, ports: tuple[int, int], targets: Path) -> None:
    env = {
        **os.environ,
        "HPC_PROMETHEUS_PORT": str(ports[0]),
        "HPC_PUSHGATEWAY_PORT": str(ports[1]),
        "HPC_PROMETHEUS_TARGETS": f"{targets}/prometheus/*.json",
    }
    subprocess.run(["bash", str(ROOT / "envs/prometheus/server.sh"), verb, str(state)], check=True, env=env)


def prometheus_query(port: int, expr: str) -> list[dict]:
    import urllib.parse
    import urllib.request

    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)["data"]["result"]


def run_variant(variant: str, args: argparse.Namespace, run_dir: Path, uri: str, ports=(0, 0)) -> dict:
    sets = [
        f"train.steps={args.steps}", "train.log_every=1", "train.eval_every=0", f"job.nodes={args.nodes}",
        f"job.ranks_per_node={args.ranks}", f"checkpoint.every_steps={args.ckpt_every}", "checkpoint.keep_last=2",
        f"tracking.backend={'mlflow' if variant in TRACKED else 'off'}", *args.set,
    ]  # fmt: skip
    if variant == "server":
        sets.append(f"tracking.uri={uri}")
    if variant == "live":
        sets += ["live.serve=true", f"live.pushgateway=http://127.0.0.1:{ports[1]}", "live.push_every_s=1"]
    cmd = [sys.executable, "-m", "hpc.submit", "tiny", "--local", "--run-dir", str(run_dir)]
    cmd += [a for kv in sets for a in ("--set", kv)]
    env = {k: v for k, v in os.environ.items() if k not in ("HPC_TRACKING", "MLFLOW_TRACKING_URI")}
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{variant} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = lines(run_dir / "metrics.jsonl")
    out = {
        "wall_s": wall,
        "step_time_s": [r["step_time_s"] for r in records if r["step"] > args.skip],
        "sync_s": [r.get("time_sync_s", 0.0) for r in records if r["step"] > args.skip],
    }
    if variant == "live":  # how often Prometheus scraped the endpoints, and whether the last push is the last step
        name = run_dir.name
        scraped = prometheus_query(ports[0], f'count_over_time(hpc_step{{run="{name}",instance!=""}}[1h])')
        out["scrapes"] = sum(int(s["value"][1]) for s in scraped)
        time.sleep(2.5)  # Prometheus scrapes the gateway every second
        pushed = prometheus_query(ports[0], f'hpc_step{{run="{name}",instance=""}}')
        out["last_push_is_last_step"] = bool(pushed) and all(int(s["value"][1]) == records[-1]["step"] for s in pushed)
    if variant in TRACKED:
        out["tracker_steps"] = tracker_steps(run_dir)
        out["every_step_once"] = out["tracker_steps"] == [r["step"] for r in records]
        out["cost"] = json.loads((run_dir / "tracking.json").read_text())["cost"]
    return out


def tracker_steps(run_dir: Path) -> list[int]:
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "tracking.json").read_text())
    history = MlflowClient(state["uri"]).get_metric_history(state["run_id"], "step_time_s")
    return sorted(m.step for m in history)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    work.mkdir(parents=True, exist_ok=True)
    port, state = free_port(), work / "mlflow-server"
    server, live = "server" in args.variants, "live" in args.variants
    if server:
        server_script("start", state, port)
    ports = (free_port(), free_port())
    if live:  # the live runs' folder holds their target files, which Prometheus watches
        prometheus_script("start", work / "prometheus", ports, work / "live")
    uri = f"http://127.0.0.1:{port}"
    chosen = args.variants
    runs: dict[str, list[dict]] = {v: [] for v in chosen}
    try:
        for i in range(args.rounds):
            order = chosen[i % len(chosen) :] + chosen[: i % len(chosen)]
            for variant in order:
                run_dir = work / "live" / f"r{i}" if variant == "live" else work / f"r{i}" / variant / "run"
                runs[variant].append(run_variant(variant, args, run_dir, uri, ports))
    finally:
        if server:
            server_script("wipe", state, port)
        if live:
            prometheus_script("wipe", work / "prometheus", ports, work / "live")
    emit(summarize(args, runs), args.json, show)
    return 0


def summarize(args: argparse.Namespace, runs: dict[str, list[dict]]) -> dict:
    rows = {}
    for variant, found in runs.items():
        steps = [t for r in found for t in r["step_time_s"]]
        rows[variant] = {
            "median_step_s": statistics.median(steps),
            "mean_step_s": statistics.fmean(steps),
            "median_sync_s": statistics.median(t for r in found for t in r["sync_s"]),
            "median_wall_s": statistics.median(r["wall_s"] for r in found),
            "runs": len(found),
        }
        if variant == "live":
            rows[variant]["scrapes_per_run"] = statistics.median(r["scrapes"] for r in found)
            rows[variant]["last_push_is_last_step"] = all(r["last_push_is_last_step"] for r in found)
        if variant in TRACKED:
            rows[variant]["every_step_once"] = all(r["every_step_once"] for r in found)
            costs = [r["cost"] for r in found]
            per_step = statistics.median(c["send_cpu_s"] / c["records"] for c in costs)
            rows[variant]["write_us_per_record"] = statistics.median(c["write_us_per_record"] for c in costs)
            rows[variant]["open_cpu_s"] = statistics.median(c["open_cpu_s"] for c in costs)
            rows[variant]["send_cpu_ms_per_step"] = 1000 * per_step
            # the most the tracker can cost a step where the ranks leave no core idle: its thread's CPU time
            rows[variant]["bound_share_of_step"] = (
                per_step + 1e-6 * rows[variant]["write_us_per_record"]
            ) / statistics.median(t for r in runs["off"] for t in r["step_time_s"])
    base, mean = rows["off"]["median_step_s"], rows["off"]["mean_step_s"]
    for variant in [v for v in rows if v != "off"]:
        rows[variant]["ratio_step_over_off"] = rows[variant]["median_step_s"] / base
        rows[variant]["ratio_mean_over_off"] = rows[variant]["mean_step_s"] / mean
    return {
        "benchmark": "tracking",
        "setup": {
            "steps": args.steps,
            "skip": args.skip,
            "rounds": args.rounds,
            "ckpt_every": args.ckpt_every,
            "nodes": args.nodes,
            "ranks_per_node": args.ranks,
        },  # fmt: skip
        "variants": rows,
    }


def show(result: dict) -> None:
    s, rows = result["setup"], result["variants"]
    print(
        f"tracking cost: {s['nodes']} node(s) x {s['ranks_per_node']} rank(s), {s['steps']} steps (median of steps "
        f"after {s['skip']}, {s['rounds']} rounds), a checkpoint and a tracker send every {s['ckpt_every']} steps"
    )
    print("| tracking | median step ms | ratio | mean step ms | ratio | sync ms | wall s | every step once |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for variant, r in rows.items():
        ratio = f"{r.get('ratio_step_over_off', 1.0):.3f}"
        mean_ratio = f"{r.get('ratio_mean_over_off', 1.0):.3f}"
        once = str(r.get("every_step_once", "-"))
        print(f"| {variant} | {1000 * r['median_step_s']:.2f} | {ratio} | {1000 * r['mean_step_s']:.2f} | "
              f"{mean_ratio} | {1000 * r['median_sync_s']:.3f} | {r['median_wall_s']:.1f} | {once} |")  # fmt: skip
    if "live" in rows:
        r = rows["live"]
        print(f"live: {r['scrapes_per_run']:.0f} samples of hpc_step scraped per run (every node's endpoint, every "
              f"second); the last push is the last step: {r['last_push_is_last_step']}")  # fmt: skip
    print()
    print("what the tracker itself costs rank 0 (per logged step; its process runs under SCHED_IDLE):")
    print("| tracking | write() us | open CPU s (once) | send CPU ms/step | bound, share of a step |")
    print("|---|---:|---:|---:|---:|")
    for variant, r in rows.items():
        if "write_us_per_record" in r:
            print(f"| {variant} | {r['write_us_per_record']:.1f} | {r['open_cpu_s']:.2f} | "
                  f"{r['send_cpu_ms_per_step']:.3f} | {100 * r['bound_share_of_step']:.2f}% |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
