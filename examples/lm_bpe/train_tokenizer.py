"""Train the byte-level BPE tokenizer of this example and save it as tokenizer.json next to this script.

    python examples/lm_bpe/train_tokenizer.py            # about a second on 2 cores, no download

The result is committed (examples/lm_bpe/tokenizer.json), so a run needs no training step; run this again only to
change the tokenizer (a changed tokenizer.json has another SHA-256, so the trainer prepares a new dataset for it).

Deterministic: the first FILES of the standard library's top-level *.py modules in sorted order, vocabulary
VOCAB_SIZE, ByteLevel pre-tokenizer and decoder (every byte is representable: no unknown token), and one special
token <|eos|> that `python -m trainer.data prepare` appends after every document.
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 2048
FILES = 150
EOS = "<|eos|>"


def source_files(count: int = FILES) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"))[:count]


def train(files: list[Path], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("tokenizer.json"))
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    files = source_files()
    start = time.perf_counter()
    tok = train(files, args.vocab_size)
    tok.save(str(args.out))
    sample = "def main(argv=None):\n    return 0\n"
    ids = tok.encode(sample).ids
    assert tok.decode(ids) == sample
    print(
        f"trained a byte-level BPE of {tok.get_vocab_size()} tokens on {len(files)} files "
        f"({sum(f.stat().st_size for f in files) / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s: "
        f"{args.out} ({args.out.stat().st_size / 1e3:.0f} kB); {len(sample)} chars -> {len(ids)} tokens"
    )


if __name__ == "__main__":
    main()
