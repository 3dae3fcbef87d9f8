"""karpathy's nanoGPT as a side-by-side peer of bench/overhead.py (``--nanogpt DIR``, a checkout of
https://github.com/karpathy/nanoGPT: this project does not ship or download it).

``prepare`` copies the checkout's ``train.py``, ``model.py`` and ``configurator.py`` into the work folder and
applies the two edits that let ``train.py`` run data-parallel on CPU (with ``RANK`` set it forces
``cuda:<LOCAL_RANK>`` and ``DDP(device_ids=...)``; both now only when the device is CUDA), writes the benchmark's
prepared dataset in nanoGPT's format (``data/<name>/train.bin`` and ``val.bin``: uint16 tokens, ``meta.pkl`` with the
vocabulary size) and a nanoGPT config file with the trainer's model shape, batch, optimizer and schedule (biases on,
as the built-in GPT has them: the same parameter count, checked after the run). nanoGPT then runs unmodified
otherwise, under torchrun (or mpirun over an emulated link), with ``--device=cpu --compile=False --backend=gloo
--dtype=float32``; its per-iteration ``time ...ms`` lines are the step times."""

from __future__ import annotations

import pickle
import re
import shutil
from pathlib import Path

import h5py
import numpy as np

FILES = ("train.py", "model.py", "configurator.py")
DATASET = "hpc"  # data/hpc/ in the work folder
#: (what train.py says, what it says after the edit): the only changes made to nanoGPT's code.
EDITS = (
    (
        "    device = f'cuda:{ddp_local_rank}'\n    torch.cuda.set_device(device)\n",
        "    if device.startswith('cuda'):\n"
        "        device = f'cuda:{ddp_local_rank}'\n        torch.cuda.set_device(device)\n",
    ),
    (
        "model = DDP(model, device_ids=[ddp_local_rank])",
        "model = DDP(model, device_ids=[ddp_local_rank] if device_type == 'cuda' else None)",
    ),
)
#: (what model.py says, what it says after the edit): only for the ``nanogpt-fused`` variant, AdamW's fused kernels
#: on CPU as well (nanoGPT asks for them on CUDA only).
FUSED_EDIT = (
    "use_fused = fused_available and device_type == 'cuda'",
    "use_fused = fused_available and device_type in ('cuda', 'cpu')",
)
ITER_RE = re.compile(r"^iter (\d+): loss [-0-9.naif]+, time ([0-9.]+)ms", re.MULTILINE)
PARAMS_RE = re.compile(r"num (?:non-)?decayed parameter tensors: \d+, with ([\d,]+) parameters")


class NanoGPTError(RuntimeError):
    pass


def prepare(src: Path, folder: Path, data: Path, cfg, world: int, *, fused_cpu: bool = False) -> Path:
    """The work folder nanoGPT runs in (its cwd): the checkout's files with the CPU edits, the dataset and the
    config. ``cfg`` is the trainer's RunConfig for the same run; ``world`` the number of ranks; ``fused_cpu``: with
    FUSED_EDIT too."""
    src = src.expanduser().resolve()
    missing = [name for name in FILES if not (src / name).is_file()]
    if missing:
        raise NanoGPTError(
            f"--nanogpt {src}: {', '.join(missing)} not found there; pass a checkout of "
            "https://github.com/karpathy/nanoGPT (git clone https://github.com/karpathy/nanoGPT)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(src / name, folder / name)
    train = (folder / "train.py").read_text()
    for before, after in EDITS:
        if after in train:  # edited already (by hand, as EDITS says)
            continue
        if before not in train:
            raise NanoGPTError(
                f"--nanogpt {src}: train.py does not contain {before.strip().splitlines()[0]!r}, one of the two lines "
                "this benchmark edits so that nanoGPT's DDP runs on CPU; it is not karpathy/nanoGPT's train.py "
                "(or that file has changed): make the change of bench/nanogpt.py's EDITS by hand and run again"
            )
        train = train.replace(before, after, 1)
    (folder / "train.py").write_text(train)
    if fused_cpu:
        model = (folder / "model.py").read_text()
        if FUSED_EDIT[0] not in model:
            raise NanoGPTError(
                f"--nanogpt {src}: model.py does not contain {FUSED_EDIT[0]!r}, the line the nanogpt-fused variant "
                "edits so that AdamW runs fused on CPU; run without that variant"
            )
        (folder / "model.py").write_text(model.replace(*FUSED_EDIT, 1))
    write_dataset(data, folder / "data" / DATASET)
    write_config(folder / "bench_config.py", cfg, world)
    return folder


def write_dataset(data: Path, out: Path) -> None:
    """The prepared HDF5 shards as nanoGPT reads them: each split's tokens concatenated into one uint16 file."""
    from trainer.data.dataset import read_manifest  # the trainer's own check of a prepared dataset's manifest

    manifest = read_manifest(data)
    if manifest["vocab_size"] > 1 << 16:
        raise NanoGPTError(f"{data}: vocabulary {manifest['vocab_size']} does not fit nanoGPT's uint16 token files")
    out.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train.bin"), ("val", "val.bin")):
        with open(out / name, "wb") as f:
            for shard in manifest["splits"][split]:
                with h5py.File(data / shard["file"], "r") as h5:
                    f.write(np.asarray(h5["tokens"][:], dtype=np.uint16).tobytes())
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": int(manifest["vocab_size"])}, f)


def write_config(path: Path, cfg, world: int) -> None:
    """A nanoGPT config file (plain assignments, read by its configurator.py) for the trainer's run: the same model
    shape, micro-batch, global batch (gradient_accumulation_steps is per run: nanoGPT divides it by the world size),
    AdamW settings, clipping, learning-rate schedule and step count; no evaluation after the first (nanoGPT
    evaluates at iteration 0 whatever eval_interval is: one batch, inside the first, skipped, step), no
    checkpoints, no wandb."""
    m, t = cfg.model, cfg.train
    values = {
        "out_dir": str(path.parent / "out"),
        "dataset": DATASET,
        "eval_interval": t.steps + 1,
        "eval_iters": 1,
        "log_interval": 1,
        "always_save_checkpoint": False,
        "wandb_log": False,
        "batch_size": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // t.micro_batch_size,
        "block_size": m.seq_len,
        "n_layer": m.n_layers,
        "n_head": m.n_heads,
        "n_embd": m.d_model,
        "dropout": float(m.dropout),
        "bias": True,
        "learning_rate": t.lr,
        "min_lr": t.min_lr,
        "weight_decay": t.weight_decay,
        "beta1": t.beta1,
        "beta2": t.beta2,
        "grad_clip": t.grad_clip,
        "decay_lr": True,
        "warmup_iters": t.warmup_steps,
        "lr_decay_iters": t.steps,
        "max_iters": t.steps - 1,  # nanoGPT runs iterations 0..max_iters
        "device": "cpu",
        "compile": False,
        "backend": "gloo",
        "dtype": "float32",
    }
    if m.mlp_ratio != 4:
        raise NanoGPTError(f"model.mlp_ratio={m.mlp_ratio}: nanoGPT's MLP is 4 x n_embd wide")
    if values["gradient_accumulation_steps"] % world:
        raise NanoGPTError(f"global batch {t.global_batch_size} is not a multiple of micro-batch x {world} ranks")
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in values.items()))


def command(folder: Path, python: str) -> list[str]:
    """train.py's arguments (after the launcher): the config file, as nanoGPT's README runs it."""
    return [python, str(folder / "train.py"), "bench_config.py"]


def step_times(log: Path) -> list[float]:
    """Seconds per iteration, from rank 0's ``iter N: loss L, time T ms`` lines."""
    return [float(ms) / 1e3 for _, ms in ITER_RE.findall(log.read_text(errors="replace"))]


def n_params(log: Path) -> int | None:
    """The parameters nanoGPT's optimizer holds (decayed + not decayed; the tied embedding once)."""
    found = PARAMS_RE.findall(log.read_text(errors="replace"))
    return sum(int(n.replace(",", "")) for n in found[:2]) if len(found) >= 2 else None


def fused_adamw(log: Path) -> bool:
    """Whether nanoGPT's AdamW ran fused (its ``using fused AdamW: ...`` line)."""
    return "using fused AdamW: True" in log.read_text(errors="replace")
