"""``python -m trainer.sample RUN_DIR|EXPORT_DIR --prompt TEXT``: a few continuations from the built-in GPT, as a
quick look at whether the trained weights are sane. A run directory is exported first (its newest valid checkpoint,
into a temporary folder: trainer/export.py); the text is encoded with the export's tokenizer.json, or as bytes."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from trainer.data.formats import EOS
from trainer.export import CONFIG, MANIFEST, TOKENIZER, ExportError, export, load_gpt


class Codec:
    """Text to ids and back: the export's tokenizer.json, or bytes (ids 0..255, then the end-of-document id EOS)."""

    def __init__(self, folder: Path) -> None:
        path = folder / TOKENIZER
        self.tokenizer = None
        if path.is_file():
            import tokenizers

            self.tokenizer = tokenizers.Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return bytes(i for i in ids if i < EOS).decode("utf-8", errors="replace")


@torch.no_grad()
def generate(model: torch.nn.Module, ids: list[int], tokens: int, *, temperature: float, top_k: int,
             generator: torch.Generator, stop: int | None) -> list[int]:  # fmt: skip
    """``tokens`` more ids after ``ids``, sampled (the context cut to the model's sequence length)."""
    window = model.cfg.seq_len
    out = list(ids)
    for _ in range(tokens):
        context = torch.tensor([out[-window:]], dtype=torch.long)
        logits = model(context)[0, -1].float() / max(temperature, 1e-6)
        if top_k:
            cutoff = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < cutoff, float("-inf"))
        nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if nxt == stop:
            break
        out.append(nxt)
    return out[len(ids) :]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.sample", description=__doc__.split("\n\n")[0])
    p.add_argument("path", type=Path, help="a run directory, or a folder `python -m trainer.export` wrote")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per continuation")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest (0: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hpc-sample-") as tmp:
        folder = args.path
        try:
            if not (folder / MANIFEST).is_file():
                export(args.path, Path(tmp) / "export")
                folder = Path(tmp) / "export"
            model = load_gpt(folder)
        except (ExportError, OSError, ValueError) as exc:
            print(f"error: {exc}.", file=sys.stderr)
            return 2
        config = json.loads((folder / CONFIG).read_text())
        codec = Codec(folder)
        ids = codec.encode(args.prompt)
        if not ids:
            print("error: --prompt encodes to no tokens.", file=sys.stderr)
            return 2
        generator = torch.Generator().manual_seed(args.seed)
        stop = None if codec.tokenizer is not None else EOS
        step = json.loads((folder / MANIFEST).read_text())["step"]
        print(f"# {config['recipe']} at step {step}, {args.samples} continuation(s) of {args.prompt!r}")
        for n in range(args.samples):
            new = generate(model, ids, args.tokens, temperature=args.temperature, top_k=args.top_k,
                           generator=generator, stop=stop)  # fmt: skip
            print(f"--- {n + 1}\n{args.prompt}{codec.decode(new)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
