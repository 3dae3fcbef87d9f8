"""``python -m trainer.export RUN_DIR [--step N] [--out DIR]``: a run's trained weights out of its checkpoints, as
one safetensors file in full precision, whatever layout trained them.

A checkpoint holds the model through torch.distributed.checkpoint under the model's own parameter names, whatever
DDP, FSDP, HSDP, TP or PP sharded at save time; one process reads the whole tensors back from it (no process group)
and writes them. The generation is the newest valid one (every file checked against its manifest's SHA-256), or
``--step``'s; ``--from-bucket`` reads it from checkpoint.storage instead: a generation whose manifest the run's key
does not authenticate is skipped before any of it is read (DCP's metadata is a pickle), each file checked as above.

The folder written: ``model.safetensors`` (the parameters and buffers, a tied parameter once), ``config.json`` (the
recipe, its architecture and arguments, the ties; for the built-in GPT how it maps onto Hugging Face's GPT-2),
``tokenizer.json`` when the run's data was prepared with one, and ``export.json`` (the run, the step, the config's
hash, the data's key, each file's SHA-256). ``load_gpt(folder)`` rebuilds the built-in GPT from it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from rundir import RunDir
from rundir.checkpoints import CheckpointInvalid, newest_valid, step_name, validate
from storage.digest import sha256_file
from storage.files import write_atomic

FORMAT = "hpc-trainer-export/1"
WEIGHTS, CONFIG, TOKENIZER, MANIFEST = "model.safetensors", "config.json", "tokenizer.json", "export.json"


class ExportError(Exception):
    """What stops an export; the message names the run, the generation or the file."""


def model_tensors(dcp_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor under ``model.`` in a DCP checkpoint, whole, read in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(dcp_dir))
    meta = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    if not state:
        raise ExportError(f"{dcp_dir} holds no model tensors")
    with warnings.catch_warnings():  # "torch.distributed is disabled ...: assuming ... a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key.removeprefix("model."): t for key, t in state.items()}


def untie(tensors: dict[str, torch.Tensor], params: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors with each tied copy left out: a name the checkpoint holds beside a parameter of the manifest whose
    tensor it equals bit for bit (the GPT's head and token embedding). Returns (tensors, {left out: kept})."""
    kept, ties = {}, {}
    for name, t in tensors.items():
        twin = next((p for p in params if p != name and p in tensors and tensors[p].shape == t.shape
                     and torch.equal(tensors[p], t)), None) if name not in params else None  # fmt: skip
        if twin is not None:
            ties[name] = twin
        else:
            kept[name] = t
    return kept, ties


def export(
    run_dir: Path, out: Path | None = None, *, step: int | None = None, from_bucket: bool = False
) -> tuple[dict, Path]:
    """Write the export of ``run_dir``'s generation (newest valid, or ``step``'s) into ``out`` (a new or empty
    folder; None: RUN_DIR/export/step_N, once the generation is chosen); returns its export.json and the folder.
    Raises ExportError, and OSError for a folder that cannot be written."""
    from safetensors.torch import save_file

    from runconfig.load import load_config

    run = RunDir(Path(run_dir))
    if not run.config.is_file():
        raise ExportError(f"{run_dir} is not a run directory (no config.yaml)")
    try:
        cfg = load_config(str(run.config))
    except Exception as exc:  # noqa: BLE001 (a config that no longer loads: named, not a traceback)
        raise ExportError(f"{run.config} cannot be read: {exc}") from None
    if out is not None and out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} is not empty; choose a new --out")
    with tempfile.TemporaryDirectory(prefix="hpc-export-") as tmp:
        gen, manifest = _generation(run, cfg, step, from_bucket, Path(tmp))
        if out is None:
            out = run.root / "export" / step_name(manifest["step"])
            if out.exists():
                raise ExportError(f"{out} exists; give --out")
        tensors = model_tensors(gen / "dcp")
        weights, ties = untie(tensors, list(manifest.get("param_shapes") or {}))
        staging = out.with_name(f".{out.name}.export-tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True, mode=0o700)  # private, as the run directory is
        save_file({k: v.contiguous() for k, v in weights.items()}, str(staging / WEIGHTS), metadata={"format": "pt"})
        config = _config(run, manifest, ties, weights)
        write_atomic(staging / CONFIG, (json.dumps(config, indent=1) + "\n").encode(), fsync=True)
        data = _data_folder(cfg)
        tokenizer = data / TOKENIZER if data is not None else None
        if tokenizer is not None and tokenizer.is_file():
            shutil.copyfile(tokenizer, staging / TOKENIZER)
        record = {
            "format": FORMAT,
            "run_dir": str(run.root.resolve()),
            "run_id": manifest.get("run_id"),
            "step": manifest["step"],
            "generation": gen.name if not from_bucket else f"{_bucket(run, cfg)}/{gen.name}",
            "config_sha256": manifest.get("config_sha256"),
            "params_sha256": manifest.get("params_sha256"),
            "data_key": _data_key(data),
            "files": {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(staging.iterdir())},
        }
        write_atomic(staging / MANIFEST, (json.dumps(record, indent=1) + "\n").encode(), fsync=True)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    return record, out


def _generation(run: RunDir, cfg, step: int | None, from_bucket: bool, tmp: Path) -> tuple[Path, dict]:  # noqa: ANN001
    root = run.root / "checkpoints"
    if from_bucket:
        return _fetch(run, cfg, step, tmp)
    try:
        if step is not None:
            path = root / step_name(step)
            if not path.is_dir():
                raise ExportError(f"{run.root} has no checkpoint of step {step} ({path} does not exist)")
            return path, validate(path)
        found = newest_valid(root, lambda text: print(f"warning: {text}", file=sys.stderr))
    except CheckpointInvalid as exc:
        raise ExportError(f"{run.root}: {exc}") from None
    if found is None:
        raise ExportError(f"{run.root} has no committed checkpoint to export")
    return found


def _bucket(run: RunDir, cfg) -> str:  # noqa: ANN001
    url = cfg.checkpoint.storage
    if not url:
        raise ExportError(f"{run.root}: checkpoint.storage is not set; there is no bucket to export from")
    return url.rstrip("/")


def _fetch(run: RunDir, cfg, step: int | None, tmp: Path) -> tuple[Path, dict]:  # noqa: ANN001
    """A bucket's generation (newest committed, or ``step``'s) downloaded into ``tmp`` and checked file by file."""
    from rundir.identity import manifest_problem, read_identity
    from storage.objstore import Store, StoreError, join
    from storage.safepath import UnsafeName, safe_join
    from trainer.checkpoint.remote import download_checked

    url, store = _bucket(run, cfg), Store(cfg.storage)
    identity = read_identity(run.identity)  # the run's key: a generation it does not authenticate is never unpickled
    try:
        names = sorted(n for n in store.sizes(url, what="checkpoint listing") if n.startswith("step_"))
        if step is not None:
            names = [n for n in names if n == step_name(step)]
        for name in reversed(names):
            try:
                raw = store.read_bytes(join(url, name, "manifest.json"), what="checkpoint manifest")
            except StoreError:
                continue  # an upload that never committed
            problem = manifest_problem(json.loads(raw), identity)  # before anything of it is downloaded
            if problem is not None:
                print(f"warning: skipping {join(url, name)}: {problem[1]}", file=sys.stderr)
                continue
            gen = safe_join(tmp, name, flat=True)
            gen.mkdir()
            (gen / "manifest.json").write_bytes(raw)
            files = json.loads(raw).get("files", {})
            targets = {rel: safe_join(gen, rel) for rel in files}  # every name checked before any download
            for rel, target in targets.items():
                if not download_checked(store, join(url, name, rel), target, files[rel]):
                    raise ExportError(f"{join(url, name, rel)} does not match its SHA-256 in the manifest (corrupt)")
            return gen, validate(gen, verify_hashes=False)  # each file's hash was checked as it arrived
    except (StoreError, OSError, UnsafeName, CheckpointInvalid, ValueError) as exc:
        raise ExportError(f"{url}: {exc}") from None
    which = f"of step {step}" if step is not None else "committed"
    raise ExportError(f"{url} holds no checkpoint {which}")


def _config(run: RunDir, manifest: dict, ties: dict[str, str], weights: dict[str, torch.Tensor]) -> dict:
    config = {
        "format": FORMAT,
        "recipe": manifest.get("recipe"),
        "architecture": manifest.get("architecture"),
        "recipe_args": manifest.get("recipe_args"),
        "tied": ties,
        "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()}),
    }
    if manifest.get("recipe") == "gpt":
        config["gpt"] = manifest["architecture"]
        config["hugging_face"] = gpt2_equivalent(manifest["architecture"])
    return config


def gpt2_equivalent(arch: dict) -> dict:
    """How the built-in GPT maps onto Hugging Face's GPT-2 (pre-norm blocks, learned positions, tied embeddings, exact
    GELU, LayerNorm eps 1e-5): its config, and the renaming (GPT-2's attention is one fused c_attn of q, k and v, and
    its Conv1D layers hold the transposed weight)."""
    same = not arch.get("doc_mask")
    return {
        "matches": "GPT2LMHeadModel" if same else None,
        "why_not": None if same else "model.doc_mask keeps attention inside each document, which GPT-2 does not",
        "config": {"model_type": "gpt2", "vocab_size": arch["vocab_size"], "n_positions": arch["seq_len"],
                   "n_embd": arch["d_model"], "n_layer": arch["n_layers"], "n_head": arch["n_heads"],
                   "n_inner": arch["mlp_ratio"] * arch["d_model"], "activation_function": "gelu",
                   "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True},
        "weights": {"tok.weight": "transformer.wte.weight", "pos.weight": "transformer.wpe.weight",
                    "blocks.N.ln1": "transformer.h.N.ln_1", "blocks.N.ln2": "transformer.h.N.ln_2",
                    "blocks.N.attn.{q,k,v}": "transformer.h.N.attn.c_attn (q, k, v concatenated, transposed)",
                    "blocks.N.attn.proj": "transformer.h.N.attn.c_proj (transposed)",
                    "blocks.N.mlp.0": "transformer.h.N.mlp.c_fc (transposed)",
                    "blocks.N.mlp.2": "transformer.h.N.mlp.c_proj (transposed)", "ln_f": "transformer.ln_f"},
    }  # fmt: skip


def _data_folder(cfg) -> Path | None:  # noqa: ANN001
    """The prepared dataset the run read (data.path or the first-use cache folder), when it is on this machine."""
    from rundir.contract import data_cache
    from storage.objstore import is_url
    from trainer.data.folder import dataset_folder

    try:
        if cfg.recipe != "gpt" and not cfg.data.path:
            return None
        if cfg.data.path and is_url(cfg.data.path):
            return None
        folder = dataset_folder(cfg.data, data_cache(os.environ))
    except Exception:  # noqa: BLE001 (a config or cache that cannot be read: no data to name)
        return None
    return folder if (folder / "manifest.json").is_file() else None


def _data_key(data: Path | None) -> str | None:
    if data is None:
        return None
    try:
        return json.loads((data / "manifest.json").read_text()).get("key")
    except (OSError, ValueError):
        return None


def load_gpt(folder: str | Path) -> torch.nn.Module:
    """The built-in GPT rebuilt from an export folder, in evaluation mode, on the CPU."""
    from safetensors.torch import load_file

    from runconfig.schema import ModelConfig
    from trainer.models.gpt import GPT

    folder = Path(folder)
    config = json.loads((folder / CONFIG).read_text())
    if config.get("recipe") != "gpt":
        raise ExportError(f"{folder} holds recipe {config.get('recipe')!r}, not the built-in GPT")
    model = GPT(ModelConfig(**config["gpt"]))
    weights = load_file(str(folder / WEIGHTS))
    for name, twin in config.get("tied", {}).items():
        weights.setdefault(name, weights[twin])
    model.load_state_dict(weights, strict=True)
    return model.eval()


def gpt2_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """An exported built-in GPT's weights under Hugging Face GPT-2's names and layouts (config.json's
    ``hugging_face``): ``GPT2LMHeadModel(GPT2Config(**config["hugging_face"]["config"])).load_state_dict(...)``."""
    model = load_gpt(folder)  # the ties restored and the names checked
    config = json.loads((Path(folder) / CONFIG).read_text())
    if not (config.get("hugging_face") or {}).get("matches"):
        raise ExportError(f"{folder}: {config.get('hugging_face', {}).get('why_not') or 'no GPT-2 equivalent'}")
    w = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {"transformer.wte.weight": w["tok.weight"], "transformer.wpe.weight": w["pos.weight"]}
    for n in range(len(model.blocks)):
        b, h = f"blocks.{n}.", f"transformer.h.{n}."
        qkv = [f"{b}attn.{x}" for x in "qkv"]
        out |= {
            f"{h}ln_1.weight": w[f"{b}ln1.weight"], f"{h}ln_1.bias": w[f"{b}ln1.bias"],
            f"{h}attn.c_attn.weight": torch.cat([w[f"{x}.weight"] for x in qkv]).t().contiguous(),
            f"{h}attn.c_attn.bias": torch.cat([w[f"{x}.bias"] for x in qkv]),
            f"{h}attn.c_proj.weight": w[f"{b}attn.proj.weight"].t().contiguous(),
            f"{h}attn.c_proj.bias": w[f"{b}attn.proj.bias"],
            f"{h}ln_2.weight": w[f"{b}ln2.weight"], f"{h}ln_2.bias": w[f"{b}ln2.bias"],
            f"{h}mlp.c_fc.weight": w[f"{b}mlp.0.weight"].t().contiguous(), f"{h}mlp.c_fc.bias": w[f"{b}mlp.0.bias"],
            f"{h}mlp.c_proj.weight": w[f"{b}mlp.2.weight"].t().contiguous(),
            f"{h}mlp.c_proj.bias": w[f"{b}mlp.2.bias"],
        }  # fmt: skip
    out |= {"transformer.ln_f.weight": w["ln_f.weight"], "transformer.ln_f.bias": w["ln_f.bias"]}
    out["lm_head.weight"] = w["head.weight"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, help="the folder to write (new or empty; default RUN_DIR/export/step_N)")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest valid one)")
    p.add_argument("--from-bucket", action="store_true", help="read the checkpoint from checkpoint.storage")
    args = p.parse_args(argv)
    try:
        record, out = export(args.run_dir, args.out, step=args.step, from_bucket=args.from_bucket)
    except ExportError as exc:
        print(f"error: {exc}.", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot write the export of {args.run_dir}: {exc.strerror or exc} (give --out).", file=sys.stderr)
        return 2
    size = record["files"][WEIGHTS]["size"]
    print(f"exported step {record['step']} of {args.run_dir} into {out}: {WEIGHTS} ({size / 1e6:.1f} MB), "
          f"{', '.join(n for n in record['files'] if n != WEIGHTS)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
