"""`hpc status` and `hpc runs` read files that a killed process, a full disk or a hand may have left odd: a history
line without an event, a loss that is not a number, a step that is a string. They print what they can, never a
traceback."""

from __future__ import annotations

import json

from runconfig import dump_yaml, load_config
from rundir import RunDir
from tests.conftest import run_cli


def test_odd_history_and_metrics_lines_are_shown_not_a_traceback(tmp_path):
    run = RunDir(tmp_path / "runs" / "odd")
    run.create()
    run.config.write_text(dump_yaml(load_config("tiny", ["train.steps=10"])))
    lines = [{"time": 1.0}, {"event": "start", "time": 2.0, "step": 0}, {"event": 3}, {"event": "resume"}, [1, 2]]
    run.history.write_text("".join(json.dumps(x) + "\n" for x in lines) + "not json\n")
    records = [{"step": 1, "loss": "nan?"}, {"step": "2", "loss": None}, {"step": 3, "loss": [1]}, {"loss": 2.5}]
    run.metrics.write_text("".join(json.dumps(x) + "\n" for x in records))
    for args in (["status", str(run.root)], ["status", str(run.root), "--json"], ["runs", str(tmp_path / "runs")],
                 ["runs", str(tmp_path / "runs"), "--json"]):  # fmt: skip
        proc = run_cli(["-m", "hpc", *args])
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (args, proc.stdout, proc.stderr)
        assert "odd" in proc.stdout, proc.stdout
