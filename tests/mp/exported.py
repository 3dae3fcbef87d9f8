"""The check that a run's export reproduces it: ``python -m trainer.export`` of an evaluated step, loaded with
``load_gpt`` in one plain process, gives the run's eval loss on the same held-out windows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from runconfig import load_config
from tests.conftest import run_cli
from trainer.data.dataset import TokenShards, read_manifest
from trainer.export import load_gpt
from trainer.loop.evaluate import eval_ids
from trainer.recipes.gpt import next_token_loss


def assert_export_reproduces_eval(run_dir: Path, out: Path | None, *, from_bucket: bool = False) -> dict:
    """Export the newest evaluated step that still has its checkpoint (into ``out``, or None: the default,
    RUN_DIR/export/step_N); its eval loss, recomputed from the export, within float rounding of the run's (the ranks
    summed theirs in another order). Returns export.json."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r["eval_loss"] for r in records if r.get("eval_loss") is not None}
    kept = {int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*")}
    step = max(set(evaluated) & kept) if not from_bucket else max(evaluated)
    args = ["-m", "trainer.export", str(run_dir), "--step", str(step), *(["--out", str(out)] if out else [])]
    proc = run_cli([*args, *(["--from-bucket"] if from_bucket else [])])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if out is None:
        out = run_dir / "export" / f"step_{step:08d}"
        assert f"into {out}:" in proc.stdout and not list(run_dir.glob(".export-*")), proc.stdout
    model = load_gpt(out)
    cfg = load_config(str(run_dir / "config.yaml"))
    folder = Path(cfg.data.path)
    val = TokenShards(folder, read_manifest(folder), "val", cfg.model.seq_len)
    ids, mb = eval_ids(len(val), cfg.train.eval_sequences), cfg.train.micro_batch_size
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids), mb):
            batch = torch.from_numpy(np.stack([val[int(i)] for i in ids[start : start + mb]]))
            total += float(next_token_loss(model, batch)) * len(batch)
    val.close()
    assert abs(total / len(ids) - evaluated[step]) < 2e-6, (step, total / len(ids), evaluated[step])
    return json.loads((out / "export.json").read_text())
