"""Peak device memory and step time of FSDP2 with and without parallel.offload, on one device.

    python bench/offload_memory.py [--device cuda|cpu] [--d-model 768 --layers 12 --heads 12 --seq-len 1024]
                                   [--batch 8] [--steps 4] [--json PATH]

Each mode runs in a process of its own (a process's peak is its own): the built-in GPT sharded by the trainer's
own ``trainer.parallel.fsdp.shard`` over a one-rank mesh (NCCL on a GPU, gloo on CPU), AdamW from
``trainer.loop.optim``, ``--steps`` steps of forward, backward and update on random tokens. Reported per mode: the
device's peak allocated memory (``torch.cuda.max_memory_allocated``; 0 on CPU), where the parameters' shards and
the optimizer state live (bytes per device type), the host's peak resident memory, and the median step time. One
rank is enough to see what offload moves: the shards it keeps in host memory are the whole model's at dp_shard 1,
1/N of it at dp_shard N (the trainer refuses offload without sharding; this script calls the sharding directly).
On CPU both modes keep everything in host memory: the rehearsal checks the path, not the saving.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT, bench_parser, emit  # bench/ is on sys.path

MODES = ("resident", "offload")


def parse_args(argv: list[str] | None):
    p = bench_parser(__doc__)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)  # one mode, in this process
    return p.parse_args(argv)


def bytes_by_device(tensors) -> dict[str, int]:
    """Bytes of the local pieces of ``tensors`` (DTensors' shards), per device type."""
    from trainer.observe.memory import local_part, nbytes

    out: dict[str, int] = {}
    for t in tensors:
        kind = local_part(t).device.type
        out[kind] = out.get(kind, 0) + nbytes(t)
    return out


def child(args) -> dict:
    """One mode, in this process: the figures as a dict (printed as the last line of JSON)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from runconfig.schema import ModelConfig, TrainConfig
    from trainer.loop.optim import build_optimizer, clip_grad_norm
    from trainer.models.gpt import GPT, loss_fn
    from trainer.parallel.fsdp import find_blocks, shard

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="offload-bench-") as tmp:
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            if device.type == "cuda":
                torch.cuda.set_device(0)
            mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
            cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len,
                              dropout=0.0)  # fmt: skip
            torch.manual_seed(0)
            model = GPT(cfg).to(device)
            blocks = find_blocks(model, None, recipe="gpt")
            shard(model, blocks, mesh, param_dtype=None, reshard_after_forward=True, offload=args.child == "offload")
            opt = build_optimizer(model, TrainConfig())
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.steps):
                batch = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), device=device)
                started = time.perf_counter()
                loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
                clip_grad_norm(list(model.parameters()), 1.0)  # the trainer's: a norm over (offloaded) shards
                opt.step()
                opt.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
            state = [s for group in opt.state.values() for s in group.values() if isinstance(s, torch.Tensor)]
            # what the trainer's checkpoints do with the shards: gather them whole (the fingerprint), save and load
            whole = [p.full_tensor().cpu() for p in model.parameters()]
            dcp.save({"model": model.state_dict()}, checkpoint_id=f"{tmp}/ckpt")
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            loaded = {"model": model.state_dict()}
            dcp.load(loaded, checkpoint_id=f"{tmp}/ckpt")
            again = [p.full_tensor().cpu() for p in model.parameters()]
            restored = all(torch.equal(a, b) for a, b in zip(whole, again, strict=True))
            return {
                "device_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else 0.0,
                "params_bytes": bytes_by_device(model.parameters()),
                "optimizer_bytes": bytes_by_device(s for s in state if s.dim() > 0),
                "host_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "step_s_median": statistics.median(times[1:] or times),
                "n_params": sum(p.numel() for p in model.parameters()),
                "checkpoint_restored": restored,
                "final_loss": float(loss_fn(model(batch[:, :-1]), batch[:, 1:]).detach()),
            }
        finally:
            dist.destroy_process_group()


def measure(args) -> dict:
    rows = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--child", mode, "--device", args.device, "--d-model", str(args.d_model),
               "--layers", str(args.layers), "--heads", str(args.heads), "--seq-len", str(args.seq_len),
               "--batch", str(args.batch), "--steps", str(args.steps)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode:
            raise SystemExit(f"offload_memory: the {mode} run failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    res, off = rows["resident"], rows["offload"]
    return {
        "device": args.device,
        "model": {
            "d_model": args.d_model,
            "layers": args.layers,
            "heads": args.heads,
            "seq_len": args.seq_len,
            "n_params": res["n_params"],
        },  # fmt: skip
        "batch": args.batch,
        "steps": args.steps,
        "modes": rows,
        "device_peak_saved_mb": res["device_peak_mb"] - off["device_peak_mb"],
        "step_time_ratio": off["step_s_median"] / res["step_s_median"],
    }


def show(result: dict) -> None:
    print(f"{'mode':<10} {'device peak MB':>15} {'params on':>12} {'optimizer on':>13} {'host RSS MB':>12} "
          f"{'step s':>8}")  # fmt: skip
    for mode, r in result["modes"].items():
        where = ",".join(sorted(r["params_bytes"]))
        opt_where = ",".join(sorted(r["optimizer_bytes"]))
        print(f"{mode:<10} {r['device_peak_mb']:>15.1f} {where:>12} {opt_where:>13} {r['host_peak_rss_mb']:>12.1f} "
              f"{r['step_s_median']:>8.3f}")  # fmt: skip
    print(f"device peak saved: {result['device_peak_saved_mb']:.1f} MB; step time x{result['step_time_ratio']:.2f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    emit(measure(args), args.json, show)
    return 0


if __name__ == "__main__":
    sys.exit(main())
