"""The control plane at N simulated ranks: rank 0's rendezvous store and watchdog against N-1 ranks' real clients.

    python bench/scale.py [--ranks 64 256 1024 4096] [--hosts H] [--per-rank] [--heartbeat-s 2] [--peer-timeout-s 15]
        [--json PATH]

For each N: rank 0 (bench/scale_ranks.py: the store's server and rank 0's watchdog, in a process of its own) and
``--hosts`` processes holding ranks 1..N-1, each rank with the store connection, relay and watchdog threads of a real
one (a simulated node's ranks relay through its first rank, across processes where a node spans two).
Measured: rank 0's CPU share, memory, descriptors and sockets in steady training; the store's operations per second
and the latency of a probe's sealed write and read; a roll call's time; the time from a rank's silence to the claim
that names it; the time until every live rank has seen that claim (what ends a launch everywhere).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import scale_gathers  # bench/ is on sys.path
from common import ROOT, bench_parser, emit, tree_cpu_s, wait

RANKS = (64, 256, 1024, 4096)
RANKS_PER_HOST = 256  # at 1,024 a process, answering a roll call at 4,096 ranks cost 4x the CPU (its GIL)


def parse_args(argv: list[str] | None):
    p = bench_parser(__doc__)
    p.add_argument("--ranks", type=int, nargs="+", default=list(RANKS), help="world sizes (default 64 256 1024 4096)")
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="processes that hold the simulated ranks (default: one "
        f"per {RANKS_PER_HOST} ranks, at least 2; more ranks a process contend for its interpreter lock)",
    )
    p.add_argument("--per-node", type=int, default=8, help="ranks per simulated node (default 8)")
    p.add_argument("--per-rank", action="store_true", help="every rank its own store connections and heartbeat key "
                   "(no node relay: trainer/observe/noderelay.py), as before 2026-12-06")  # fmt: skip
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="monitor.heartbeat_s (default 2, the default)")
    p.add_argument("--peer-timeout-s", type=float, default=15.0, help="monitor.peer_timeout_s (default 15)")
    p.add_argument("--steady-s", type=float, default=0.0, help="steady window (default: 4 heartbeats, at least 8 s)")
    return p.parse_args(argv)


def proc_status(pid: int) -> dict:
    """Resident memory (MB), descriptors and sockets of a process now."""
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    fds = sockets = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
            fds += 1
        except OSError:
            continue
    return {"rss_mb": round(rss, 1), "fds": fds, "sockets": sockets}


def ops_now(work: Path, hosts: int) -> int:
    total = 0
    for name in ["ops_0"] + [f"ops_{h}" for h in range(1, hosts + 1)]:
        try:
            total += int((work / name).read_text())
        except (OSError, ValueError):
            continue
    return total


def probe_latency(store, seal, seconds: float) -> list[float]:
    """Seconds of a sealed write and a read of it (a rank's heartbeat and rank 0's read of one), back to back."""
    from trainer.observe.beats import peek

    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        t = time.perf_counter()
        store.set("hpc/scale/probe", seal.seal("hpc/scale/probe", "x"))
        peek(store, "hpc/scale/probe")
        out.append(time.perf_counter() - t)
        time.sleep(0.02)
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def host_count(args, world: int) -> int:
    return min(args.hosts or max(2, -(-world // RANKS_PER_HOST)), world - 1)


def start(work: Path, args, world: int, secret: bytes) -> list[subprocess.Popen]:
    """Rank 0, then the hosts of ranks 1..world-1, the launch's secret on their stdin."""
    script = [sys.executable, str(ROOT / "bench" / "scale_ranks.py")]
    relay = str(int(not args.per_rank))
    common = [str(world), str(args.per_node), str(args.heartbeat_s), str(args.peer_timeout_s), relay]
    # This machine reaches no DNS server: a name lookup that torch's socket layer makes when many clients connect at
    # once waits out the resolver (5 s by default); 1 s here. A cluster's resolver answers.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RES_OPTIONS": "timeout:1 attempts:1"}

    def spawn(name: str, argv: list[str]) -> subprocess.Popen:  # its output to a log in the work folder
        with open(work / f"{name}.log", "w") as log:
            return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    text=True)  # fmt: skip

    procs = [spawn("rank0", [*script, "rank0", str(work), *common])]
    hosts = host_count(args, world)
    bounds = [1 + (world - 1) * h // hosts for h in range(hosts + 1)]
    for h in range(hosts):
        argv = [*script, "ranks", str(work), *common, str(h + 1), str(bounds[h]), str(bounds[h + 1])]
        procs.append(spawn(f"host{h + 1}", argv))
    for p in procs:
        p.stdin.write(secret.hex() + "\n")
        p.stdin.close()
    return procs


def measure(args, world: int) -> dict:
    import torch.distributed as dist

    from trainer.observe.beats import peek
    from trainer.observe.watchdog import HANG_KEY
    from trainer.parallel.storeseal import Seal

    work = Path(tempfile.mkdtemp(prefix="hpc-scale-"))  # 0700
    (work / "go").mkdir()
    secret, hosts = os.urandom(32), host_count(args, world)
    t0 = time.perf_counter()
    procs = start(work, args, world, secret)
    try:
        port = int(wait(lambda: (work / "port").exists() and (work / "port").read_text(), timeout=120))
        wait(lambda: all((work / f"ready_{h}").exists() for h in range(1, hosts + 1)), timeout=600)
        connect_s = time.perf_counter() - t0
        (work / "go" / "start").write_text("")
        probe = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
        seal = Seal(secret, world)  # the probe seals as a rank past the world (its values are the launch's)
        time.sleep(2 * args.heartbeat_s)  # every rank has published
        steady_s = args.steady_s or max(8.0, 4 * args.heartbeat_s)
        others = [p.pid for p in procs[1:]]
        cpu0, ops0, w0 = tree_cpu_s([procs[0].pid]), ops_now(work, hosts), time.perf_counter()
        hosts0 = tree_cpu_s(others)
        lat = probe_latency(probe, seal, steady_s)
        cpu1, ops1, w1 = tree_cpu_s([procs[0].pid]), ops_now(work, hosts), time.perf_counter()
        hosts1 = tree_cpu_s(others)
        status = proc_status(procs[0].pid)
        (work / "go" / "rollcall_1").write_text("")
        roll_cpu = tree_cpu_s(others)
        roll = json.loads(wait(lambda: (work / "rollcall_1.json").exists() and (work / "rollcall_1.json").read_text(),
                               timeout=120))  # fmt: skip
        roll["hosts_cpu_s"] = tree_cpu_s(others) - roll_cpu  # what answering cost the simulated ranks, in all
        (work / "go" / "rearm").write_text("")
        wait(lambda: all((work / f"rearmed_{h}").exists() for h in range(1, hosts + 1)), timeout=120)
        (work / "go" / f"silence_{hosts}").write_text("")
        silenced = json.loads(wait(lambda: _read(work / f"silenced_{hosts}.json"), timeout=30))
        limit = args.peer_timeout_s + 3 * args.heartbeat_s + 60
        wait(lambda: peek(probe, HANG_KEY), timeout=limit, every=0.02)
        claimed_at = time.time()
        procs[0].wait(timeout=3 * args.heartbeat_s + 30)
        failure = json.loads((work / "run" / "failure.json").read_text())
        (work / "go" / "end").write_text("")
        for p in procs[1:]:
            p.wait(timeout=60)
        seen: dict[str, float | None] = {}
        for h in range(1, hosts + 1):
            seen.update(json.loads((work / f"ranks_{h}.json").read_text())["saw_claim"])
        missed = sorted(int(r) for r, t in seen.items() if t is None)
        return {
            "ranks": world,
            "hosts": hosts,
            "connect_s": round(connect_s, 2),
            "rank0": {"cpu_share": round((cpu1 - cpu0) / (w1 - w0), 4), **status},
            "hosts_cpu_cores": round((hosts1 - hosts0) / (w1 - w0), 2),  # the simulated ranks' (machine: cpus)
            "store_ops_per_s": round((ops1 - ops0) / (w1 - w0), 1),
            "probe_ms": {"p50": round(1e3 * pct(lat, 0.5), 3), "p99": round(1e3 * pct(lat, 0.99), 3),
                         "n": len(lat)},  # fmt: skip
            "roll_call": {"s": round(roll["s"], 3), "named": roll["named"],
                          "hosts_cpu_s": round(roll["hosts_cpu_s"], 2)},
            "claim": {
                "silenced": silenced["rank"],
                "after_silence_s": round(claimed_at - silenced["at"], 2),
                "target_s": args.peer_timeout_s + 2,
                "named": [s["rank"] for s in failure.get("suspects", [])],
            },
            "claim_seen": {
                "by_all_live_s": round(max(t for t in seen.values() if t) - claimed_at, 2) if len(missed) < len(seen)
                else None,
                "missed": missed,
            },
        }  # fmt: skip
    except Exception:
        for log in sorted(work.glob("*.log")):  # what the processes said, before their folder goes
            print(f"--- {log.name} (last lines)\n" + "\n".join(log.read_text().splitlines()[-15:]), file=sys.stderr)
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(work, ignore_errors=True)


def _read(path: Path) -> str | None:
    try:
        return path.read_text() or None
    except OSError:
        return None


def show_gathers(rows: list[dict]) -> None:
    """Per gather: bytes a rank sends (the largest), in all, and the merge's milliseconds, at each N."""
    print(f"\n{'gather':>16} {'ranks':>6} {'B/rank':>8} {'MB in all':>10} {'merge ms':>9}  (what merges)")
    for r in rows:
        for name, g in r["gathers"].items():
            timed = {k: v for k, v in _flat(g).items() if k.endswith("_ms")}
            sent = g.get("bytes_per_rank_max", g.get("agreement", {}).get("bytes_per_rank_max", 0))
            total = g.get("bytes_in_all", g.get("agreement", {}).get("bytes_in_all", 0))
            what = ", ".join(f"{k}={v}" for k, v in timed.items())
            print(
                f"{name:>16} {r['ranks']:>6} {sent:>8} {total / 1e6:>10.3f} {max(timed.values(), default=0):>9}  "
                f"({what})"
            )


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def show(result: dict) -> None:
    head = ("ranks", "connect s", "rank0 cpu %", "hosts cores", "rss MB", "sockets", "store ops/s", "p50 ms", "p99 ms",
            "roll call s", "claim s", "seen by all s")  # fmt: skip
    print(" ".join(f"{h:>13}" for h in head))
    for r in result["rows"]:
        cells = (r["ranks"], r["connect_s"], round(100 * r["rank0"]["cpu_share"], 1), r["hosts_cpu_cores"],
                 r["rank0"]["rss_mb"],
                 r["rank0"]["sockets"], r["store_ops_per_s"], r["probe_ms"]["p50"], r["probe_ms"]["p99"],
                 r["roll_call"]["s"], r["claim"]["after_silence_s"], r["claim_seen"]["by_all_live_s"])  # fmt: skip
        print(" ".join(f"{c!s:>13}" for c in cells))
    show_gathers(result["rows"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup = {k: getattr(args, k) for k in ("hosts", "per_node", "per_rank", "heartbeat_s", "peer_timeout_s")}
    setup["cpus"] = os.cpu_count()
    rows = [{**measure(args, n), "gathers": scale_gathers.measure(n)} for n in args.ranks]
    emit({"benchmark": "scale", "setup": setup, "rows": rows}, args.json, show)


if __name__ == "__main__":
    main()
