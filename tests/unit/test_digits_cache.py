"""examples/digits' data cache: the first call converts scikit-learn's images into ``CACHE/digits/digits-v1.npz``;
later calls (other ranks, later launches) read that file without importing scikit-learn, and get the same arrays.
Real processes, a real cache folder in tmp_path; no training is run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOAD = """
import hashlib, json, sys
from digits.train import load_cached
pixels, labels = load_cached(sys.argv[1])
print(json.dumps({"sklearn": "sklearn" in sys.modules, "shape": list(pixels.shape), "dtype": str(pixels.dtype),
                  "sha": hashlib.sha256(pixels.tobytes() + labels.tobytes()).hexdigest()}))
"""


def load(cache: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", LOAD, str(cache)],
        capture_output=True,
        text=True,
        cwd=ROOT / "examples" / "digits",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_first_load_writes_the_cache_and_later_loads_skip_scikit_learn(tmp_path):
    first = load(tmp_path)
    assert first["sklearn"] and first["shape"] == [1797, 64] and first["dtype"] == "uint8"
    cached = tmp_path / "digits" / "digits-v1.npz"
    assert cached.is_file() and not list(cached.parent.glob(".*"))  # no temporary file left behind
    again = load(tmp_path)
    assert not again["sklearn"] and again["sha"] == first["sha"]


def test_a_damaged_cache_file_is_made_again(tmp_path):
    cached = tmp_path / "digits" / "digits-v1.npz"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not a numpy archive")
    got = load(tmp_path)
    assert got["sklearn"] and got["shape"] == [1797, 64]
    assert not load(tmp_path)["sklearn"]  # replaced by a good one
