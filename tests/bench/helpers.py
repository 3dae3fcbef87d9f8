"""Running a benchmark script as a user would: ``python bench/NAME.py ... --json PATH`` from the repository root."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT


def run_bench(
    name: str, args: list[str], tmp_path: Path, *, printed_last: bool = True, timeout: float = 300
) -> tuple[dict, str]:
    """Runs bench/NAME.py with ``args`` and ``--json tmp_path/NAME.json`` under this Python, its temporary folders
    inside ``tmp_path``; asserts it exited 0 and (unless ``printed_last`` is False: gpu_check.py prints its table
    last) that the JSON object it printed last on stdout is the one ``--json`` wrote (bench/README.md's output
    convention). Returns (the JSON it wrote, its stdout)."""
    out = tmp_path / f"{name}.json"
    scratch = tmp_path / "tmp"  # what the script leaves in its temporary folders goes with the test's
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(scratch)}
    cmd = [sys.executable, f"bench/{name}.py", *args, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    tail = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{tail}"
    left = leftovers(tmp_path)
    assert not left, f"processes of bench/{name}.py's runs still running after it exited:\n" + "\n".join(left)
    written = out.read_text()
    if printed_last:
        assert proc.stdout.rstrip().endswith("\n" + written.rstrip()), f"the JSON printed last is not --json's:\n{tail}"
    return json.loads(written), proc.stdout


def leftovers(tmp_path: Path, grace_s: float = 10.0) -> list[str]:
    """Processes whose command line names ``tmp_path`` (the ranks of the script's runs) still there ``grace_s``
    after it exited."""
    deadline = time.monotonic() + grace_s
    while True:
        found = subprocess.run(["pgrep", "-af", str(tmp_path)], capture_output=True, text=True).stdout.splitlines()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def positive(x) -> bool:
    """A finite number above zero (a time, a rate)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def stat(x) -> bool:
    """summarize()'s shape in bench/checkpoint.py: median, min, max, samples, all positive, min <= median <= max."""
    return (
        set(x) == {"median", "min", "max", "samples"}
        and all(positive(v) for v in (x["median"], x["min"], x["max"], *x["samples"]))
        and x["min"] <= x["median"] <= x["max"]
    )


def table_lines(stdout: str, *starts: str) -> list[str]:
    """The printed lines that begin (after leading spaces) with each of ``starts``, in that order of ``starts``;
    asserts every one is there."""
    lines = [line.strip() for line in stdout.splitlines()]
    found = []
    for start in starts:
        hits = [line for line in lines if line.startswith(start)]
        assert hits, f"no table line starting with {start!r} in:\n{stdout[-3000:]}"
        found.append(hits[0])
    return found
