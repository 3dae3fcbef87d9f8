"""The trainer's CUDA/NCCL path on a real GPU machine, end to end, as one short script (one lease of a GPU node).

``python bench/gpu_check.py [--out DIR] [--only CHECK ...]`` runs each check (env, shared_gpu, tiny, resume,
gloo_2x2, cp, gpt124m, gpt124m_compile, float8, offload, plain, plain_large, profile, profile_large; what each checks:
bench/README.md) through ``python -m hpc.submit ... --local`` as a user would (offload: through
bench/offload_memory.py); ``--device cpu --small`` rehearses it without a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import bench_parser, write_json  # noqa: E402 (bench/common.py: bench/ is on sys.path)

from rundir.contract import EXIT_STOPPED, EXIT_USER_ERROR  # noqa: E402

# The resume check's run: small and short, dropout on, a checkpoint every 4 steps.
RESUME_SETS = [
    "train.steps=24", "train.warmup_steps=2", "train.eval_every=8", "model.d_model=64", "model.n_layers=2",
    "model.seq_len=64", "checkpoint.every_steps=4", "checkpoint.keep_last=3", "model.dropout=0.1",
]  # fmt: skip
GPT124M_SETS = [
    "model.d_model=768", "model.n_layers=12", "model.n_heads=12", "model.seq_len=1024", "train.global_batch_size=16",
    "train.micro_batch_size=16", "train.steps=40", "train.warmup_steps=4", "train.eval_every=0",
    "checkpoint.every_steps=0",
]  # fmt: skip

# plain_large: 4x the tokens per step (two micro-batches of 32), where the device sets the pace, not the host.
LARGE = ["train.global_batch_size=64", "train.micro_batch_size=32"]


class Runner:
    def __init__(self, work: Path, device: str, log: Path) -> None:
        self.work, self.device, self.log = work, device, log
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), self.env.get("PYTHONPATH", "")) if p)
        self.env["HPC_DATA_CACHE"] = str(work / "data-cache")

    def args(self, target: str, run_dir: Path | None, layout: tuple[int, int], sets: list[str]) -> list[str]:
        nodes, ranks = layout
        out = [sys.executable, "-m", "hpc.submit", target, "--local"]
        if run_dir is not None:
            out += ["--run-dir", str(run_dir)]
        for s in [f"job.nodes={nodes}", f"job.ranks_per_node={ranks}", f"train.device={self.device}", *sets]:
            out += ["--set", s]
        return out

    def start(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen(
            args, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def finish(self, name: str, proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += f"\n[gpu_check: killed after {timeout:.0f} s]"
        with self.log.open("a") as f:
            f.write(f"\n===== {name}: {' '.join(map(str, proc.args))}\n===== exit {proc.returncode}\n{out}\n")
        return proc.returncode, out

    def run(self, name: str, target: str, layout: tuple[int, int], sets: list[str], timeout: float = 300):
        run_dir = self.work / name
        started = time.perf_counter()
        rc, out = self.finish(name, self.start(self.args(target, run_dir, layout, sets)), timeout)
        return rc, out, run_dir, time.perf_counter() - started


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []


def steady(rows: list[dict], skip: int) -> dict:
    """Medians over the steps after the first ``skip`` (warm-up, compilation)."""
    rows = [r for r in rows if r.get("step", 0) > skip and "tokens_per_s" in r]
    if not rows:
        return {}
    out = {
        "steps_measured": len(rows),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        "step_time_ms": 1e3 * statistics.median(r["step_time_s"] for r in rows),
        "peak_mem_mb": max(r.get("peak_mem_mb", 0.0) for r in rows),
    }
    if all("mfu" in r for r in rows):
        out["mfu"] = statistics.median(r["mfu"] for r in rows)
    for part in ("data", "compute", "comm", "optim", "sync"):  # the trainer's step-time breakdown
        if all(f"time_{part}_s" in r for r in rows):
            out[f"{part}_ms"] = 1e3 * statistics.median(r[f"time_{part}_s"] for r in rows)
    return out


def summary(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def rank_pids(run_dir: Path) -> list[int]:
    pids = subprocess.run(["pgrep", "-f", f"trainer --run-dir {run_dir}"], capture_output=True, text=True)
    out = []
    for pid in pids.stdout.split():
        try:
            if any(x.startswith(b"PMI_RANK=") for x in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")):
                out.append(int(pid))
        except OSError:
            pass
    return out


def check_env() -> dict:
    import torch

    out: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    probe = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
    mpi = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    out["mpi"] = mpi.stdout.strip() or mpi.stderr.strip()[-300:]
    mpirun = Path(sys.executable).parent / "mpirun"
    out["mpirun_beside_python"] = mpirun.exists()
    return {"ok": True, **out}


def check_shared_gpu(r: Runner) -> dict:
    rc, out, _, wall = r.run("shared_gpu", "tiny", (1, 2), ["comm.backend=nccl", "train.steps=4"], timeout=180)
    named = "would share one GPU" in out
    lines = [x for x in out.splitlines() if "share one GPU" in x]
    return {"ok": rc == EXIT_USER_ERROR and named, "exit": rc, "wall_s": wall, "message": lines[:1]}


def check_tiny(r: Runner) -> dict:
    rc, _, run_dir, wall = r.run("tiny", "tiny", (1, 1), [])
    s = summary(run_dir)
    res = {"exit": rc, "wall_s": wall, "backend": s.get("backend"), "final_loss": s.get("final_loss")}
    res.update(eval_loss=s.get("final_eval_loss"), **steady(metrics(run_dir), 20))
    res["ok"] = rc == 0 and s.get("final_loss") is not None and s["final_loss"] < 3.0
    return res


def check_resume(r: Runner, layout: tuple[int, int]) -> dict:
    ref_rc, _, ref_dir, _ = r.run("resume_ref", "tiny", layout, RESUME_SETS)
    run_dir = r.work / "resume_cut"
    proc = r.start(r.args("tiny", run_dir, layout, RESUME_SETS))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if any(row.get("step", 0) >= 8 for row in metrics(run_dir)):
            break
        time.sleep(0.05)
    for pid in rank_pids(run_dir):
        os.kill(pid, signal.SIGUSR2)
    cut_rc, _ = r.finish("resume_cut", proc, 180)
    stopped_at = max((row.get("step", 0) for row in metrics(run_dir)), default=0)
    resume_args = [sys.executable, "-m", "hpc.submit", "--resume", str(run_dir), "--local"]
    res_rc, _ = r.finish("resume_resumed", r.start(resume_args), 300)
    sync_rc, _, sync_dir, _ = r.run("resume_sync", "tiny", layout, [*RESUME_SETS, "comm.defer_agreement=false"])
    a, b = summary(ref_dir), summary(run_dir)
    keys = ("step", "loss", "grad_norm", "eval_loss", "tokens_seen")

    def rows(d: Path) -> list[dict]:
        return [{k: x.get(k) for k in keys} for x in metrics(d)]

    same_rows, same_sync = rows(ref_dir) == rows(run_dir), bool(rows(ref_dir)) and rows(ref_dir) == rows(sync_dir)
    same = a.get("params_sha256") is not None and a.get("params_sha256") == b.get("params_sha256")
    return {
        "ok": [ref_rc, cut_rc, res_rc, sync_rc] == [0, EXIT_STOPPED, 0, 0] and same and same_rows and same_sync,
        "exits": [ref_rc, cut_rc, res_rc, sync_rc],
        "stopped_at_step": stopped_at,
        "params_identical": same,
        "losses_identical": same_rows,
        "records_equal_undeferred": same_sync,
    }


def check_gpt124m(r: Runner, compile_: bool) -> dict:
    name = "gpt124m_compile" if compile_ else "gpt124m"
    sets = [*GPT124M_SETS, *(["parallel.compile=true"] if compile_ else [])]
    rc, _, run_dir, wall = r.run(name, "tiny", (1, 1), sets, timeout=420)
    s = summary(run_dir)
    return {"ok": rc == 0, "exit": rc, "wall_s": wall, "n_params": s.get("n_params"), **steady(metrics(run_dir), 10)}


def check_float8(r: Runner) -> dict:
    """The GPT-2-small shape compiled, in bf16 and in float8 (train.precision; emulated off a GPU): tokens/s of each,
    their ratio, and their final losses, which must agree within 0.1 (40 steps)."""
    runs: dict = {}
    for name, precision in (("float8_bf16", "bf16"), ("float8", "float8")):
        emulate = ["train.float8_emulate=true"] if precision == "float8" and r.device != "cuda" else []
        sets = [*GPT124M_SETS, "parallel.compile=true", f"train.precision={precision}", *emulate]
        rc, _, run_dir, wall = r.run(name, "tiny", (1, 1), sets, timeout=600)
        s = summary(run_dir)
        runs[name] = {"exit": rc, "wall_s": wall, "final_loss": s.get("final_loss"), **steady(metrics(run_dir), 10)}
    bf16, f8 = runs["float8_bf16"], runs["float8"]
    res: dict = {"ok": all(x["exit"] == 0 and x["final_loss"] is not None for x in runs.values()), **runs}
    if res["ok"]:
        res["speedup"] = f8["tokens_per_s"] / bf16["tokens_per_s"]
        res["loss_difference"] = abs(f8["final_loss"] - bf16["final_loss"])
        res["ok"] = res["loss_difference"] < 0.1
    return res


def check_offload(r: Runner, small: bool) -> dict:
    """bench/offload_memory.py at GPT-2-small's shape (--small: the tiny one): the device's peak memory with FSDP2's
    shards resident and offloaded to host memory (parallel.offload), one device each, in processes of their own.
    On a GPU the offloaded run must keep its parameters and optimizer state in host memory and save at least half
    of their size at the peak; both must get their parameters back whole from a DCP save and load (the gradient
    norm, the gathers and the checkpoints of offloaded shards are the trainer's own calls)."""
    shape = ["--d-model", "64", "--layers", "2", "--heads", "4", "--seq-len", "64"] if small else []
    out = r.work / "offload.json"
    cmd = [sys.executable, str(ROOT / "bench" / "offload_memory.py"), "--device", r.device, *shape, "--json", str(out)]
    started = time.perf_counter()
    rc, _ = r.finish("offload", r.start(cmd), 900)
    res = json.loads(out.read_text()) if out.exists() else {}
    fig: dict = {"exit": rc, "wall_s": time.perf_counter() - started}
    if rc or not res:
        return {"ok": False, **fig}
    resident, offload = res["modes"]["resident"], res["modes"]["offload"]
    state_mb = sum(resident["params_bytes"].values()) / 2**20 + sum(resident["optimizer_bytes"].values()) / 2**20
    fig |= {"state_mb": state_mb, "device_peak_resident_mb": resident["device_peak_mb"],
            "device_peak_offload_mb": offload["device_peak_mb"], "device_peak_saved_mb": res["device_peak_saved_mb"],
            "step_time_ratio": res["step_time_ratio"], "loss_resident": resident["final_loss"],
            "loss_offload": offload["final_loss"]}  # fmt: skip
    fig["checkpoint_restored"] = resident["checkpoint_restored"] and offload["checkpoint_restored"]
    on_host = set(offload["params_bytes"]) == {"cpu"} and set(offload["optimizer_bytes"]) == {"cpu"}
    on_host = on_host and fig["checkpoint_restored"]
    saved = r.device != "cuda" or res["device_peak_saved_mb"] > 0.5 * state_mb
    return {"ok": on_host and saved, **fig}


def check_plain(r: Runner, rounds: int, name: str = "plain", more: list[str] | None = None) -> dict:
    """The trainer against plain DDP (bench/plain_ddp.py under torchrun) on the GPT-2-small shape, alternated
    ``rounds`` times: tokens/s (median over steps after 10) and the trainer's share of plain's; also the trainer
    with ``monitor.device_sync=true`` (the device synchronized at each phase boundary of the breakdown). ``more``:
    settings on top of the shape (``plain_large``: 4x the tokens per step, so that the device, not the host's
    kernel launches, sets the pace)."""
    sets = [*GPT124M_SETS, *(more or [])]
    trainer, hostsync, plain, breakdown = [], [], [], {}
    for i in range(rounds):
        for variant, extra, into in (("trainer", [], trainer), ("hostsync", ["monitor.device_sync=true"], hostsync)):
            rc, _, run_dir, _ = r.run(f"{name}_{variant}_{i}", "tiny", (1, 1), [*sets, *extra], timeout=300)
            if rc != 0:
                return {"ok": False, f"{variant}_exit": rc}
            figures = steady(metrics(run_dir), 10)
            into.append(figures["tokens_per_s"])
            breakdown[variant] = {k: v for k, v in figures.items() if k.endswith("_ms")}
        out = r.work / f"{name}_{i}.json"
        rc, _ = r.finish(f"{name}_{i}", r.start(plain_cmd(r, out, sets)), 300)
        if rc != 0 or not out.exists():
            return {"ok": False, "plain_exit": rc, "trainer_tokens_per_s": trainer}
        res = json.loads(out.read_text())
        plain.append(res["tokens_per_step"] / statistics.median(res["step_time_s"][10:]))
    t, h, q = statistics.median(trainer), statistics.median(hostsync), statistics.median(plain)
    return {"ok": True, "trainer_tokens_per_s": t, "hostsync_tokens_per_s": h, "plain_tokens_per_s": q,
            "ratio": t / q, "ratio_hostsync": h / q, "rounds": rounds, "each_trainer": trainer,
            "each_hostsync": hostsync, "each_plain": plain,
            "ratio_each_round": [a / b for a, b in zip(trainer, plain, strict=True)],
            "ratio_hostsync_each_round": [a / b for a, b in zip(hostsync, plain, strict=True)],
            "breakdown_last_round": breakdown}  # fmt: skip


def plain_cmd(r: Runner, out: Path, sets: list[str], extra: list[str] | None = None) -> list[str]:
    """bench/plain_ddp.py under torchrun on one GPU, the GPT-2-small shape, the prepared data of the trainer's runs."""
    data = next((r.work / "data-cache").rglob("manifest.json")).parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += [str(ROOT / "bench" / "plain_ddp.py"), "--device", r.device, "--data", str(data), "--json", str(out)]
    for s in ["job.nodes=1", "job.ranks_per_node=1", *sets]:
        cmd += ["--set", s]
    return cmd + (extra or [])


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# CUDA calls that can hold the host until the device has reached them (a copy from or to pageable memory can too)
HOST_WAITS = {"cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
              "cudaMemcpy", "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize"}  # fmt: skip
WAIT_MIN_US = 100.0  # a call this long held the host: it waited for the device (a launch takes a few microseconds)


def trace_steps(path: Path) -> dict:
    """A Chrome trace's marked steps ("optimizer step N" on the host): each step's wall time, the device's busy
    time inside it (the union of kernels, copies and sets: where the device idles shows as the rest), its longest
    idle gap, and the device time per kernel name (summed over the steps; the largest few), to tell a device that
    waits from one that does more work; and where the host waited for the device inside the steps (``host_waits``:
    the longest CUDA calls of HOST_WAITS over WAIT_MIN_US, each with its time into the step and the operators around
    it, outermost > innermost), to find what drains the device's queue. On CPU (no device events) only the wall
    times."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    marks = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and str(e.get("name")).startswith("optimizer step ")),
        key=lambda e: e["ts"],
    )
    device = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") in DEVICE_CATEGORIES)
    steps, by_name, waits = [], {}, []
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    for m in marks:
        lo, hi = m["ts"], m["ts"] + m["dur"]
        busy = gap = 0.0
        cursor = lo
        for start, end, name in device:
            if end <= lo or start >= hi:
                continue
            start, end = max(start, lo), min(end, hi)
            by_name[name] = by_name.get(name, 0.0) + (end - start)
            if start > cursor:
                gap = max(gap, start - cursor)
            busy += max(0.0, end - max(start, cursor))
            cursor = max(cursor, end)
        gap = max(gap, hi - cursor) if device else 0.0
        waited = 0.0
        for e in events:
            if e["name"] in HOST_WAITS and e["dur"] >= WAIT_MIN_US and lo <= e["ts"] < hi:
                waited += e["dur"]
                around = sorted(
                    (o for o in ops if o.get("tid") == e.get("tid") and o["ts"] <= e["ts"] <= o["ts"] + o["dur"]),
                    key=lambda o: -o["dur"],
                )
                names = [o["name"] for o in around]
                names = names if len(names) <= 3 else [names[0], "...", *names[-2:]]
                waits.append({"step": m["name"].split()[-1], "call": e["name"], "ms": e["dur"] / 1e3,
                              "at_ms": (e["ts"] - lo) / 1e3, "ops": " > ".join(names)})  # fmt: skip
        steps.append({"step": m["name"].split()[-1], "wall_ms": m["dur"] / 1e3, "device_busy_ms": busy / 1e3,
                      "longest_idle_ms": gap / 1e3, "host_wait_ms": waited / 1e3})  # fmt: skip
    wall = sum(x["wall_ms"] for x in steps)
    busy = sum(x["device_busy_ms"] for x in steps)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {
        "steps": steps,
        "wall_ms_per_step": wall / max(1, len(steps)),
        "device_busy_ms_per_step": busy / max(1, len(steps)),
        "device_busy_share": busy / wall if wall and device else None,
        "top_device_ms_per_step": {name[:80]: ms / 1e3 / max(1, len(steps)) for name, ms in top},
        "host_wait_ms_per_step": sum(x["host_wait_ms"] for x in steps) / max(1, len(steps)),
        "host_waits": sorted(waits, key=lambda w: -w["ms"])[:10],
    }


def check_profile(r: Runner, prefix: str = "profile", more: list[str] | None = None) -> dict:
    """Steps 20-21 of the GPT-2-small shape under torch.profiler: the trainer (``monitor.profile_steps``, without
    and with ``monitor.device_sync``) and plain DDP (bench/plain_ddp.py ``--profile-steps``), each step's wall time
    against the device's busy time inside it and the host's waits for the device (trace_steps). ``more``: settings
    on top of the shape (``profile_large``: plain_large's, where the device sets the pace). The traces and tables
    come back in runs.tar.gz."""
    res: dict = {}
    shape = [*GPT124M_SETS, *(more or [])]
    for name, extra in (("trainer", []), ("trainer_hostsync", ["monitor.device_sync=true"])):
        sets = [*shape, "monitor.profile_steps=20-21", *extra]
        rc, _, run_dir, _ = r.run(f"{prefix}_{name}", "tiny", (1, 1), sets)
        trace = run_dir / "profile" / "rank_00000.json"
        res[name] = {"exit": rc, **(trace_steps(trace) if trace.exists() else {})}
    trace = r.work / f"{prefix}_plain" / "profile" / "plain.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    extra = ["--profile-steps", "20-21", "--profile-out", str(trace)]
    cmd = plain_cmd(r, r.work / f"{prefix}_plain" / "plain.json", shape, extra)
    rc, _ = r.finish(f"{prefix}_plain", r.start(cmd), 300)
    res["plain"] = {"exit": rc, **(trace_steps(trace) if trace.exists() else {})}
    res["ok"] = all(x["exit"] == 0 and x.get("steps") for x in res.values())
    for name in ("trainer", "trainer_hostsync", "plain"):
        for k in ("wall_ms_per_step", "device_busy_ms_per_step", "device_busy_share", "host_wait_ms_per_step"):
            if res[name].get(k) is not None:
                res[f"{name}_{k}"] = res[name][k]
    return res


def check_gloo_2x2(r: Runner) -> dict:
    runs = {
        "hierarchical": ["comm.allreduce=hierarchical"],  # the stream hook: collectives on a side stream
        "hierarchical_sync": ["comm.allreduce=hierarchical", "comm.overlap=false"],  # inside the hook
        "flat": ["comm.allreduce=flat"],
    }
    res: dict = {}
    for name, more in runs.items():
        sets = ["comm.backend=gloo", *more, "train.steps=40", "train.eval_every=20"]
        rc, _, run_dir, wall = r.run(f"gloo_2x2_{name}", "tiny", (2, 2), sets)
        s = summary(run_dir)
        res[name] = {"exit": rc, "wall_s": wall, "final_loss": s.get("final_loss"), "sha": s.get("params_sha256")}
        res[name]["losses"] = [row.get("loss") for row in metrics(run_dir)]
        log0 = run_dir / "logs" / "rank_00000.log"
        checked = [x for x in (log0.read_text() if log0.exists() else "").splitlines() if "comm.overlap:" in x]
        res[name]["overlap_check"] = checked[0].split(" INFO ", 1)[-1] if checked else None
    res["ok"] = all(res[a]["exit"] == 0 and res[a]["final_loss"] is not None for a in runs)
    # The trainer's start-up check ran the side stream against the synchronous reduction
    # (trainer.startup.allreduce.check_overlap; a mismatch ends the run before step 1, so exit 0 means it passed).
    checked = res["hierarchical"]["overlap_check"] or ""
    res["stream_checked"] = "side stream gave the synchronous one's bits" in checked
    # The side stream must give the bits of the same algorithm run inside the hook (2 x 2 ranks on one GPU: the
    # kernels are the same, and gloo sums in a fixed order).
    hier, sync = res["hierarchical"], res["hierarchical_sync"]
    res["stream_equals_sync"] = hier["sha"] is not None and hier["sha"] == sync["sha"]
    res["stream_losses_equal_sync"] = bool(hier["losses"]) and hier["losses"] == sync["losses"]
    if res["ok"]:
        res["loss_difference"] = abs(hier["final_loss"] - res["flat"]["final_loss"])
        res["ok"] = res["loss_difference"] < 0.05 and res["stream_equals_sync"] and res["stream_losses_equal_sync"]
        res["ok"] = res["ok"] and (res["stream_checked"] or r.device != "cuda")
    return res


def check_cp(r: Runner) -> dict:
    """Context parallelism (parallel.cp=2) on 2 x 2 ranks sharing the device over gloo: on a GPU torch's own ring
    over its CUDA attention kernels (on CPU the trainer's CPU kernels), against FSDP2 over the same 2 ranks without
    it (the same sharding of the state); the losses must agree within 0.05 after 24 steps (bf16 on a GPU)."""
    res: dict = {}
    for name, more in (("cp", ["parallel.cp=2"]), ("fsdp", ["parallel.dp_shard=2"])):
        sets = ["comm.backend=gloo", *more, "train.steps=24", "train.eval_every=12"]
        rc, _, run_dir, wall = r.run(f"cp_{name}", "tiny", (2, 2), sets)
        s = summary(run_dir)
        res[name] = {"exit": rc, "wall_s": wall, "final_loss": s.get("final_loss"), "parallel": s.get("parallel"),
                     "eval_loss": s.get("final_eval_loss"), **steady(metrics(run_dir), 8)}  # fmt: skip
    cp, fsdp = res["cp"], res["fsdp"]
    res["ok"] = cp["exit"] == 0 and fsdp["exit"] == 0 and None not in (cp["final_loss"], fsdp["final_loss"])
    if res["ok"]:
        res["loss_difference"] = abs(cp["final_loss"] - fsdp["final_loss"])
        res["ok"] = res["loss_difference"] < 0.05 and (cp["parallel"] or {}).get("cp") == 2
    return res


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--out", type=Path, help="write gpu_check.json, runs.log and runs.tar.gz here")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: rehearse without a GPU")
    p.add_argument("--only", nargs="*", help="run only these checks")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the plain checks (default 3)")
    p.add_argument("--small", action="store_true", help="a tiny model instead of GPT-2-small (rehearsal)")
    args = p.parse_args(argv)
    if args.small:
        GPT124M_SETS[:5] = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64",
                            "train.global_batch_size=16"]  # fmt: skip
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    log = out_dir / "runs.log"
    r = Runner(work, args.device, log)
    cuda = args.device == "cuda"
    checks = {
        "env": check_env,
        "shared_gpu": (lambda: check_shared_gpu(r)) if cuda else None,
        "tiny": lambda: check_tiny(r),
        "resume": lambda: check_resume(r, (1, 1)),
        "gloo_2x2": (lambda: check_gloo_2x2(r)) if cuda else None,
        "cp": lambda: check_cp(r),
        "gpt124m": lambda: check_gpt124m(r, False),
        "gpt124m_compile": lambda: check_gpt124m(r, True),
        "float8": lambda: check_float8(r),
        "offload": lambda: check_offload(r, args.small),
        "plain": lambda: check_plain(r, args.rounds),
        "plain_large": lambda: check_plain(r, args.rounds, "plain_large", LARGE),
        "profile": lambda: check_profile(r),
        "profile_large": lambda: check_profile(r, "profile_large", LARGE),
    }
    results: dict = {}
    for name, fn in checks.items():
        if fn is None or (args.only and name not in args.only):
            continue
        started = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 (one check's failure must not lose the others' figures)
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        results[name]["check_s"] = round(time.perf_counter() - started, 1)
        for path in (out_dir / "gpu_check.json", args.json):  # after every check: a lease cut short keeps them
            if path is not None:
                write_json(path, results)
        print(f"[{name}] {json.dumps(results[name])}", flush=True)
    print(f"\n{'check':<16} {'ok':<5} {'s':>6}  figures")
    for name, res in results.items():
        figures = {k: v for k, v in res.items() if k not in ("ok", "check_s") and not isinstance(v, (dict, list))}
        text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
        print(f"{name:<16} {str(res['ok']):<5} {res['check_s']:>6}  {text[:300]}")
    with tarfile.open(out_dir / "runs.tar.gz", "w:gz") as tar:  # every run's records, for a later look
        for path in sorted(work.glob("*/*")):
            if path.name in ("metrics.jsonl", "summary.json", "history.jsonl", "failure.json", "profile"):
                tar.add(path, arcname=str(path.relative_to(work)))
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(res["ok"] for res in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
