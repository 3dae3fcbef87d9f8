"""DiLoCo (comm.sync=diloco) against DDP between 2 nodes joined by an emulated slow link: tokens/s, and the loss at
equal tokens.

    python bench/diloco.py [--link-mbit 20] [--steps 200] [--sync-every 50] [--ranks 1] [--link-steps 12]
        [--fragments F] [--reps 3] [--set KEY=VALUE ...] [--outer KEY=VALUE ...] [--json PATH]

Three runs of the same layout (2 nodes x ``--ranks``), the same data order and seed: ``ddp-free``, DDP with every
rank on one network (the inter-node link costs nothing: the no-cost figure); ``ddp-link``, DDP with each node in a
network namespace of its own, joined by a veth pair shaped to ``--link-mbit`` (bench/common.py, root only), for
``--link-steps`` steps (its losses are ddp-free's, checked bitwise: the same algorithm); ``diloco-link``, DiLoCo over
that link; with ``--fragments F`` a fourth, ``streaming-link``, the same DiLoCo streaming in F fragments
(comm.sync_fragments). ``--outer`` overrides go to the DiLoCo runs only. Throughput is tokens over the summed step
times after ``--skip`` warm-up steps; a run's longest step before its last is its worst stall (a whole model's
meeting, or a fragment's; at the last step every fragment meets); the loss at equal tokens is the mean of the last
``--tail`` steps' losses, and the evaluation at the last step (where every node's model has met; 256 held-out
sequences). ``--reps`` repeats the runs; the ratios are medians over the repetitions, each computed inside its own
repetition (the runs side by side). Without ``--link-mbit`` (a smoke test, or no root) the link runs are unshaped.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import LINK_IFNAME, LINK_IPS, ROOT, bench_parser, emit, emulated_link, lines  # bench/ is on sys.path

from rundir.contract import NODE_WRAP_VAR


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--link-mbit", type=float, default=20.0, help="the emulated link's rate (0: unshaped)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of ddp-free and diloco-link")
    p.add_argument("--link-steps", type=int, default=12, help="optimizer steps of ddp-link (throughput only)")
    p.add_argument("--sync-every", type=int, default=50, help="comm.sync_every (H)")
    p.add_argument("--ranks", type=int, default=1, help="ranks per node (default 1)")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the throughput")
    p.add_argument("--tail", type=int, default=10, help="steps whose mean loss is compared")
    p.add_argument("--reps", type=int, default=1, help="repetitions of the three runs (ratios: medians)")
    p.add_argument("--fragments", type=int, default=1, help="above 1: a streaming-link run in that many fragments")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    p.add_argument("--outer", action="append", default=[], metavar="KEY=VALUE", help="overrides of the DiLoCo runs")
    args = p.parse_args(argv)
    if args.link_mbit and os.geteuid() != 0:
        p.error("--link-mbit emulates 2 nodes with network namespaces, which needs root (--link-mbit 0: unshaped)")
    if min(args.steps, args.link_steps) <= args.skip or args.steps < args.tail or args.steps % args.sync_every:
        p.error("need --steps and --link-steps > --skip, --steps >= --tail, --steps a multiple of --sync-every")
    return args


def settings(args: argparse.Namespace, data: Path) -> list[str]:
    """A model and batch where a step's compute is long against the tiny model's, its gradients large against the
    link: DDP over the link then waits on every step's all-reduce."""
    return [
        f"data.path={data}", "job.nodes=2", f"job.ranks_per_node={args.ranks}", "train.warmup_steps=10",
        "train.eval_sequences=256", "model.d_model=128", "model.n_layers=3", "model.seq_len=128",
        "train.global_batch_size=32", "train.micro_batch_size=16", "checkpoint.every_steps=0",
        "checkpoint.at_end=false", "monitor.preflight=off", "comm.allreduce=flat", *args.set,
    ]  # fmt: skip


def one(name: str, args: argparse.Namespace, data: Path, work: Path, namespaces: tuple[str, str] | None) -> dict:
    """One run: its throughput and losses."""
    steps = args.link_steps if name == "ddp-link" else args.steps
    sets = [*settings(args, data), f"train.steps={steps}", f"train.eval_every={steps}"]  # one evaluation, at the end
    if name in ("diloco-link", "streaming-link"):
        sets += ["comm.sync=diloco", f"comm.sync_every={args.sync_every}", *args.outer]
    if name == "streaming-link":
        sets.append(f"comm.sync_fragments={args.fragments}")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if namespaces is not None and name != "ddp-free":
        env[NODE_WRAP_VAR] = "|".join(f"ip netns exec {ns}" for ns in namespaces)
        env["GLOO_SOCKET_IFNAME"] = LINK_IFNAME
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        sets.append(f"comm.master_addr={LINK_IPS[0]}")
    run_dir = work / name
    cmd = [sys.executable, "-m", "hpc.submit", "tiny", "--local", "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    records = [r for r in lines(run_dir / "metrics.jsonl") if "loss" in r]
    timed = [r for r in records if r["step"] > args.skip]
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in timed)
    return {
        "name": name,
        "steps": steps,
        "wall_s": time.perf_counter() - started,
        "tokens_per_s": tokens / sum(r["step_time_s"] for r in timed),
        # the last step left out: every fragment meets there
        "longest_step_s": max(r["step_time_s"] for r in timed if r["step"] < steps),
        "losses": [r["loss"] for r in records],
        "tail_loss": sum(r["loss"] for r in records[-args.tail :]) / min(args.tail, len(records)),
        "eval_loss": records[-1]["eval_loss"],
    }


def compare(runs: dict[str, dict], args: argparse.Namespace) -> dict:
    free, link, dl = runs["ddp-free"], runs["ddp-link"], runs["diloco-link"]
    out = {
        "ddp_link_vs_free": link["tokens_per_s"] / free["tokens_per_s"],
        "diloco_link_vs_free": dl["tokens_per_s"] / free["tokens_per_s"],
        "diloco_vs_ddp_link": dl["tokens_per_s"] / link["tokens_per_s"],
        "loss_diloco_vs_ddp": dl["tail_loss"] / free["tail_loss"],
        "eval_loss_diloco_vs_ddp": dl["eval_loss"] / free["eval_loss"],
        "ddp_link_same_losses": link["losses"] == free["losses"][: len(link["losses"])],
    }
    if "streaming-link" in runs:
        st = runs["streaming-link"]
        out["streaming_link_vs_free"] = st["tokens_per_s"] / free["tokens_per_s"]
        out["loss_streaming_vs_ddp"] = st["tail_loss"] / free["tail_loss"]
        out["eval_loss_streaming_vs_ddp"] = st["eval_loss"] / free["eval_loss"]
        out["longest_step_streaming_vs_diloco"] = st["longest_step_s"] / dl["longest_step_s"]
    return out


def show(result: dict) -> None:
    print(f"\nthe last repetition's runs; ratios: medians over {result['setup']['reps']} repetition(s)")
    print(f"{'run':14} {'steps':>6} {'tokens/s':>10} {'longest step s':>15} {'tail loss':>10} {'eval loss':>10} "
          f"{'wall s':>8}")  # fmt: skip
    for r in result["runs"].values():
        print(f"{r['name']:14} {r['steps']:>6} {r['tokens_per_s']:>10.0f} {r['longest_step_s']:>15.3f} "
              f"{r['tail_loss']:>10.4f} {r['eval_loss']:>10.4f} {r['wall_s']:>8.1f}")  # fmt: skip
    c = result["compare"]
    if "streaming_link_vs_free" in c:
        print(f"streaming-link / ddp-free tokens/s: {c['streaming_link_vs_free']:.3f}; its tail loss / ddp's: "
              f"{c['loss_streaming_vs_ddp']:.4f}, eval loss: {c['eval_loss_streaming_vs_ddp']:.4f}; its longest "
              f"step / diloco's: "
              f"{c['longest_step_streaming_vs_diloco']:.3f} ({result['setup']['fragments']} fragments)")  # fmt: skip
    print(f"ddp-link / ddp-free tokens/s: {c['ddp_link_vs_free']:.3f}; diloco-link / ddp-free: "
          f"{c['diloco_link_vs_free']:.3f}; diloco's tail loss / ddp's: {c['loss_diloco_vs_ddp']:.4f}, eval loss: "
          f"{c['eval_loss_diloco_vs_ddp']:.4f} "
          f"(link {result['setup']['link_mbit'] or 'unshaped'} Mbit/s, H={result['setup']['sync_every']}; ddp-link's "
          f"losses are ddp-free's: {c['ddp_link_same_losses']})")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-diloco-"))
    from trainer.data.prepare import PrepareSpec, prepare

    data = work / "data"
    prepare(PrepareSpec(source="stdlib", include=("*.py",), max_source_bytes=2_000_000, val_fraction=0.1,
                        shard_tokens=400_000), data)  # fmt: skip
    reps = []
    linked = ["ddp-link", "diloco-link"] + (["streaming-link"] if args.fragments > 1 else [])
    for rep in range(args.reps):
        folder = work / f"rep{rep}"
        runs = {"ddp-free": one("ddp-free", args, data, folder, None)}
        if args.link_mbit:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the namespaces are removed on TERM too
            with emulated_link(args.link_mbit) as namespaces:
                for name in linked:
                    runs[name] = one(name, args, data, folder, namespaces)
        else:
            for name in linked:
                runs[name] = one(name, args, data, folder, None)
        reps.append({"runs": runs, "compare": compare(runs, args)})
    setup = {"link_mbit": args.link_mbit, "sync_every": args.sync_every, "ranks_per_node": args.ranks,
             "fragments": args.fragments, "outer": args.outer,
             "steps": args.steps, "reps": args.reps, "settings": settings(args, Path("DATA"))}  # fmt: skip
    medians = {
        k: statistics.median(r["compare"][k] for r in reps) for k in reps[0]["compare"] if k != "ddp_link_same_losses"
    }
    medians["ddp_link_same_losses"] = all(r["compare"]["ddp_link_same_losses"] for r in reps)
    result = {"benchmark": "diloco", "setup": setup, "runs": reps[-1]["runs"], "compare": medians, "reps": reps}
    emit(result, args.json, show)
    return 0


if __name__ == "__main__":
    sys.exit(main())
