"""Preparation as one Slurm job over two nodes (``srun`` one task per node, the tasks sharing the work through the
work folder): the shards are byte-identical to one process's."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT
from tests.slurm.conftest import wait_state
from trainer.data.prepare import PrepareSpec, prepare

SPEC = PrepareSpec(source="stdlib", include=("*.py",), max_source_bytes=2_000_000, val_fraction=0.1,
                   shard_tokens=200_000)  # fmt: skip


def test_two_nodes_prepare_the_shards_of_one_process(slurm, tmp_path):
    reference = prepare(SPEC, tmp_path / "one", workers=1)
    out, work = tmp_path / "two", tmp_path / "work"
    tmp_path.chmod(0o755)
    script = tmp_path / "prepare.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --time=5\n"
        f"#SBATCH --output={tmp_path}/slurm-%j.out\n"
        f"cd {ROOT}\n"
        f"srun {sys.executable} -m trainer.data prepare --source stdlib --include '*.py' --max-bytes 2000000 "
        f"--val-fraction 0.1 --shard-tokens 200000 --part-mb 1 --workers 1 --out {out} --work {work}\n"
    )
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True)
    job_id = job.stdout.strip().split(";")[0]
    info = wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=240)
    log = next(tmp_path.glob("slurm-*.out")).read_text()
    assert info["JobState"] == "COMPLETED", log
    assert "task 1 of 2: its share is done" in log and "prepared " in log, log
    assert json.loads((out / "manifest.json").read_text()) == reference
    for shard in [s for split in reference["splits"].values() for s in split]:
        assert (out / shard["file"]).read_bytes() == (tmp_path / "one" / shard["file"]).read_bytes()
    assert not work.exists()
