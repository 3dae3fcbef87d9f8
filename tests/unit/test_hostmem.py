"""train.host_mmap_threshold_kb (trainer/observe/hostmem.py): with glibc's dynamic threshold, freed tensors of a few
hundred KB stay resident once a larger block was freed; with the threshold fixed they go back to the OS. Each case
runs in a fresh process (the allocator's state is per process)."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = """
import sys
import torch
from trainer.observe.hostmem import fix_mmap_threshold

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

applied = fix_mmap_threshold(int(sys.argv[1]))
big = torch.ones(2**20)  # 4 MB: mapped, and its free raises a dynamic threshold above 512 KB
del big
before = rss_mb()
keep = [torch.ones(2**17) for _ in range(200)]  # 200 x 512 KB
last = keep[-1]
del keep  # all freed but the last, which keeps the heap's top in place
print(applied, round(rss_mb() - before, 1))
"""


def run(kib: int) -> tuple[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(kib)], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_fixed_threshold_gives_freed_tensors_back():
    applied, kept_default = run(0)
    assert applied == "False" and kept_default > 80, kept_default  # ~100 MB still resident
    applied, kept_fixed = run(256)
    assert applied == "True" and kept_fixed < 5, kept_fixed  # only the last 512 KB
