"""Bus bandwidth of flat vs the hierarchical all-reduce algorithms on N (simulated) nodes x K ranks (default 2 x 2).

``python bench/allreduce.py [--nodes N --ranks-per-node K]`` starts itself under the venv's mpirun with N x K ranks
(``--worker``); on a GPU machine each rank takes a GPU and the collectives run on NCCL (one rank per GPU: K x N at
most the GPUs, e.g. ``--nodes 2 --ranks-per-node 4`` on an 8-GPU node); every rank bootstraps like the trainer
(``trainer.env.from_mpi`` + ``trainer.parallel.distributed.init_distributed``) and times ``dist.all_reduce`` on the
default group against each of ``trainer.parallel.comm.ALGORITHMS`` (hierarchical, leader, two_level; pipelined with
``--chunk-kb``) and against ``auto``: the algorithm that ``comm.allreduce: auto``'s plan, measured at the start of
the benchmark as the trainer measures it, chose for the size; all alternated per iteration. An iteration starts at
a barrier on a group no op uses and, below 1 MiB, times a batch of back-to-back calls (as DDP issues its buckets; a
single short call after a barrier mostly measures the ranks' skew). Figures follow nccl-tests: algbw = bytes / time,
busbw = algbw * 2 (n - 1) / n. Rank 0 prints a table and a JSON object. ``--link-mbit RATE`` puts the two nodes'
ranks in two network namespaces joined by a veth pair rate-limited with tbf (root only), so the inter-node link is
slow as between real nodes. ``--compress`` adds the hierarchical all-reduce with its inter-node phase in bfloat16
(``comm.compress: bf16``); ``--chunk-kb`` the hierarchical one pipelined over chunks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from common import (  # bench/common.py (on sys.path)
    LINK_IFNAME,
    LINK_IPS,
    ROOT,
    bench_parser,
    emit,
    emulated_link,
    mpirun_and_env,
)

from rundir.contract import EXIT_USER_ERROR


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--min-bytes", type=int, default=4 << 10, help="smallest message (default 4 KiB)")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest message (default 64 MiB)")
    p.add_argument("--factor", type=int, default=4, help="size step between messages (default 4)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per size (each runs both variants)")
    p.add_argument("--iters", type=int, default=50, help="timed iterations per size, at most")
    p.add_argument("--min-iters", type=int, default=7, help="timed iterations per size, at least")
    p.add_argument(
        "--budget-mb", type=float, default=256, help="cap timed iterations at this many MB moved per variant and size"
    )
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2; one per GPU on GPUs)")
    p.add_argument("--link-mbit", type=float, help="emulate 2 real nodes joined by a link of this rate (root)")
    p.add_argument("--compress", action="store_true", help="also the hierarchical one with comm.compress=bf16")
    p.add_argument("--chunk-kb", type=float, default=0, help="also the hierarchical one pipelined over chunks of this")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--master-addr", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.min_bytes < 4 or args.max_bytes < args.min_bytes or args.factor < 2:
        p.error("need 4 <= --min-bytes <= --max-bytes and --factor >= 2")
    if args.nodes < 1 or args.ranks_per_node < 1 or args.nodes * args.ranks_per_node < 2:
        p.error("need --nodes >= 1, --ranks-per-node >= 1 and at least 2 ranks")
    if args.link_mbit and args.nodes != 2:
        p.error("--link-mbit emulates a link between 2 nodes: use --nodes 2")
    return args


def message_sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, size = [], lo
    while size <= hi:
        out.append(size - size % 4)
        size *= factor
    return out


def timed_iters(size: int, args: argparse.Namespace) -> int:
    return max(args.min_iters, min(args.iters, int(args.budget_mb * 2**20 // size)))


# --- worker (one per rank, under mpirun) ---------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from runconfig.schema import CommConfig
    from trainer.env import from_mpi
    from trainer.parallel.autotune import measure
    from trainer.parallel.distributed import init_distributed, pick_device, shutdown

    comm = MPI.COMM_WORLD
    env = from_mpi(comm)
    torch.set_num_threads(1)
    device = pick_device(env, "auto")
    d = init_distributed(env, CommConfig(timeout_s=120, master_addr=args.master_addr), device, comm)
    sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
    # comm.allreduce=auto as the trainer runs it: a plan measured on these groups at these sizes (the trainer's
    # budget and repeats), then per size the algorithm it chose
    started = time.perf_counter()
    plan = measure(d.groups, sizes, device, one_network=env.one_network)  # as the trainer: flat on one network
    plan_wall = time.perf_counter() - started
    ops = all_reduce_ops(args, d.groups, plan)
    # Each timed batch starts at a barrier on a group no op uses: a call on the barrier's own group runs up to 25 %
    # faster at 1 MiB on one host (gloo), which would favour whichever op shares it.
    fence = dist.new_group()
    setup = describe(args, env, d.backend, device)
    if env.rank == 0:
        print_header(args, setup, list(ops), plan_wall)
    rows = []
    for size in sizes:
        iters, times = time_size(size, ops, args, env, device, fence)
        gathered = comm.gather(times, root=0)
        if env.rank == 0:
            rows.append(size_row(size, iters, gathered, plan, env.world_size))
            print_row(rows[-1], list(ops))
    if env.rank == 0:
        result = {
            "benchmark": "allreduce",
            "setup": setup,
            "auto_plan": plan,
            "units": {"time": "us", "bw": "GB/s (1e9)"},
            "rows": rows,
        }
        emit(result, args.json)  # the table's rows were printed size by size
    shutdown(comm, clean=True)
    return 0


def all_reduce_ops(args: argparse.Namespace, groups, plan: dict) -> dict[str, Callable]:
    """The all-reduces compared, by name: flat (``dist.all_reduce``), the trainer's algorithms, ``auto`` as the
    trainer runs it with ``plan``, and with ``--chunk-kb``/``--compress`` the pipelined and bf16 hierarchical ones."""
    import torch.distributed as dist

    from rundir.allreduce_plan import choose
    from trainer.parallel.comm import ALGORITHMS, hierarchical_all_reduce

    ops: dict[str, Callable] = {
        "flat": lambda t: dist.all_reduce(t),
        "hier": lambda t: hierarchical_all_reduce(t, groups),
        "leader": lambda t: ALGORITHMS["leader"](t, groups),
        "two_level": lambda t: ALGORITHMS["two_level"](t, groups),
        "auto": lambda t: ALGORITHMS[choose(plan, t.numel() * 4)](t, groups),
    }
    if all(row["choice"] == "flat" for row in plan["sizes"]):  # as the trainer: DDP's own all-reduce, no hook
        ops["auto"] = ops["flat"]
    if args.chunk_kb:  # the phases pipelined over chunks of this size
        chunked = dataclasses.replace(groups, chunk_bytes=int(args.chunk_kb * 1024))
        ops["hier_pipe"] = lambda t: hierarchical_all_reduce(t, chunked)
    if args.compress:  # comm.compress=bf16: the inter-node phase in bfloat16
        compressed = dataclasses.replace(groups, compress=True)
        ops["hier_bf16"] = lambda t: hierarchical_all_reduce(t, compressed)
    return ops


def describe(args: argparse.Namespace, env, backend: str, device) -> dict:
    """The JSON's ``setup``: the ranks, the backend and device, the machine, how the times are taken."""
    import torch

    return {
        "world_size": env.world_size,
        "nodes": env.topology.num_nodes,
        "ranks_per_node": env.topology.ranks_per_node,
        "backend": backend,
        "device": str(device),
        "torch": torch.__version__,
        "threads_per_rank": torch.get_num_threads(),
        "link_mbit": args.link_mbit,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "timing": (
            "per iteration, from a barrier on a group no op uses, a batch of 2-8 back-to-back calls below 1 MiB "
            "(about 1 MiB a batch, as the plan's), else 1 call; "
            "a call's time = the batch's / calls, max over ranks; then the median over iterations"
        ),
    }


def sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def time_size(size: int, ops: dict[str, Callable], args: argparse.Namespace, env, device, fence):
    """This rank's seconds per call of every op at ``size`` bytes, per timed iteration (after checking each sums
    correctly), alternating the ops' order per iteration; returns (timed iterations, {op: [seconds]})."""
    import torch
    import torch.distributed as dist

    from trainer.parallel.autotune import BATCH_BYTES, batch_calls

    x = torch.empty(size // 4, dtype=torch.float32, device=device)
    for name, op in ops.items():  # correctness: the sum of ones is the world size
        x.fill_(1.0)
        op(x)
        sync(device)
        if not bool((x == env.world_size).all()):
            raise RuntimeError(f"{name} all-reduce of {size} bytes gave a wrong sum on rank {env.rank}")
    # below 1 MiB a batch of back-to-back calls (as the plan times them); a larger call is long enough alone
    iters, calls = timed_iters(size, args), batch_calls(size) if size < BATCH_BYTES else 1
    times: dict[str, list[float]] = {name: [] for name in ops}
    for i in range(args.warmup + iters):
        order = list(ops) if i % 2 == 0 else list(reversed(ops))
        for name in order:  # from a barrier, a batch of back-to-back calls (as DDP issues its buckets)
            x.fill_(1.0)
            sync(device)
            dist.barrier(group=fence)
            start = time.perf_counter()
            for _ in range(calls):
                ops[name](x)
            sync(device)
            if i >= args.warmup:
                times[name].append((time.perf_counter() - start) / calls)
    return iters, times


def size_row(size: int, iters: int, gathered: list[dict], plan: dict, world: int) -> dict:
    """One size's row of the JSON from every rank's times: per op the median over iterations of the slowest
    rank's time, algbw and busbw; each op's busbw over flat's; auto's choice."""
    from rundir.allreduce_plan import choose

    bus_factor = 2 * (world - 1) / world
    row: dict = {"bytes": size, "count": size // 4, "iters": iters}
    names = list(gathered[0])
    for name in names:
        per_iter = [max(rank_times[name][k] for rank_times in gathered) for k in range(iters)]
        t = statistics.median(per_iter)
        algbw = size / t / 1e9
        row[name] = {"time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor}
    for name in names:
        if name != "flat":
            row[f"ratio_{name}_over_flat"] = row[name]["busbw_GBps"] / row["flat"]["busbw_GBps"]
    row["auto_choice"] = choose(plan, size)
    return row


def print_header(args: argparse.Namespace, setup: dict, names: list[str], plan_wall: float) -> None:
    link = f"{args.link_mbit:g} Mbit/s tbf-shaped veth between nodes" if args.link_mbit else "no link emulation"
    print(
        f"all-reduce, float32, {setup['nodes']} nodes x {setup['ranks_per_node']} ranks, backend {setup['backend']} "
        f"on {setup['device']}, {link}\nbusbw = algbw * 2(n-1)/n, n = {setup['world_size']}; ratio = busbw / "
        "flat's (> 1: faster than flat); auto = comm.allreduce=auto's choice per size from the plan measured at "
        f"start-up ({plan_wall:.2f} s here)\n",
        flush=True,
    )
    others = [n for n in names if n != "flat"]
    head = " | ".join(f"{n + ' us':>11} {'ratio':>5}" for n in others)
    print(f"{'bytes':>10} {'iters':>5} | {'flat us':>10} {'busbw':>7} | {head} | auto's choice", flush=True)
    print("-" * (48 + 20 * len(others)), flush=True)


def print_row(row: dict, names: list[str]) -> None:
    cells = " | ".join(f"{row[n]['time_us']:>11.1f} {row[f'ratio_{n}_over_flat']:>5.2f}" for n in names if n != "flat")
    flat = row["flat"]
    print(
        f"{row['bytes']:>10} {row['iters']:>5} | {flat['time_us']:>10.1f} {flat['busbw_GBps']:>7.3f} | {cells} | "
        f"{row['auto_choice']}",
        flush=True,
    )


# --- launcher --------------------------------------------------------------------------------------------------


def worker_args(args: argparse.Namespace) -> list[str]:
    out = [f"--min-bytes={args.min_bytes}", f"--max-bytes={args.max_bytes}", f"--factor={args.factor}"]
    out += [f"--warmup={args.warmup}", f"--iters={args.iters}", f"--min-iters={args.min_iters}"]
    out += [f"--budget-mb={args.budget_mb}", f"--chunk-kb={args.chunk_kb}"] + (["--compress"] if args.compress else [])
    if args.link_mbit:
        out += [f"--link-mbit={args.link_mbit}", f"--master-addr={LINK_IPS[0]}"]
    if args.json:
        out += [f"--json={args.json.resolve()}"]  # rank 0 writes it
    return out


def launch(args: argparse.Namespace) -> int:
    per_node = args.ranks_per_node
    found = mpirun_and_env(per_node=per_node, threads=1)  # simulated nodes also in link mode: MPI sees one host
    if found is None:
        return EXIT_USER_ERROR
    mpirun, env = found
    worker_cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--worker", *worker_args(args)]
    start = time.perf_counter()
    if args.link_mbit:
        if os.geteuid() != 0:
            print("error: --link-mbit needs root (network namespaces)", file=sys.stderr)
            return EXIT_USER_ERROR
        env["GLOO_SOCKET_IFNAME"] = LINK_IFNAME
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns it cannot resolve the veth addresses' names
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the namespaces are removed on TERM too
        try:
            with emulated_link(args.link_mbit) as (ns_a, ns_b):
                cmd = [str(mpirun), "-n", str(per_node), "ip", "netns", "exec", ns_a, *worker_cmd]
                cmd += [":", "-n", str(per_node), "ip", "netns", "exec", ns_b, *worker_cmd]
                status = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        except RuntimeError as exc:
            print(f"error: cannot emulate the link: {exc}", file=sys.stderr)
            return EXIT_USER_ERROR
    else:
        world = args.nodes * per_node
        status = subprocess.run([str(mpirun), "-n", str(world), *worker_cmd], env=env, cwd=ROOT).returncode
    print(f"(wall time {time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else launch(args)


if __name__ == "__main__":
    sys.exit(main())
