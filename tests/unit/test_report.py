"""``python -m hpc report``: goodput accounting, launch table and figures from synthesized run directories."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.report import main as report_main
from hpc.report import step_time_lines, write_report
from hpc.runlog import analyze
from rundir import RunDir
from rundir.contract import (
    EVENT_DONE,
    EVENT_HANG,
    EVENT_RESUME,
    EVENT_START,
    EVENT_STOPPED,
    EXIT_USER_ERROR,
    PART_KEYS,
    PARTS,
)
from tests.conftest import ROOT, run_cli


def record(step: int, t: float, launch: str, step_time: float, *, data: float, ckpt: float = 0.0, **extra) -> dict:
    """A metrics record; the six parts add up to step_time (compute takes what the others leave)."""
    comm, optim, sync = 0.1 * step_time, 0.05 * step_time, 0.01 * step_time
    compute = step_time - data - ckpt - comm - optim - sync
    parts = {"data": data, "compute": compute, "comm": comm, "optim": optim, "ckpt": ckpt, "sync": sync}
    return {
        "step": step,
        "loss": 5.0 - 0.1 * step,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 4096 / step_time,
        "samples_per_s": 32 / step_time,
        "step_time_s": step_time,
        "tokens_seen": 4096 * step,
        "time": t,
        "launch": launch,
        **{key: parts[p] for p, key in zip(PARTS, PART_KEYS, strict=True)},
        **extra,
    }


def write_lines(path: Path, objs: list[dict], torn: str = "") -> None:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs) + torn)


def check(step: int, slow_rank: int | None, ratio: float) -> dict:
    """The straggler-check fields of a record on a world of 4 (2 nodes x 2)."""
    times = [1.4, 1.5, 1.45, 1.5]
    stragglers = []
    if slow_rank is not None:
        times[slow_rank] = 1.475 * ratio
        stragglers = [{"rank": slow_rank, "host": f"n{slow_rank // 2}", "node": slow_rank // 2, "ratio": ratio}]
        stragglers[0]["step_time_s"] = times[slow_rank]
    return {"rank_step_time_s": times, "stragglers": stragglers}


def make_three_launch_run(root: Path) -> RunDir:
    """Launch 1 stops at step 10 (SIGUSR2); launch 2 resumes from 10, commits 14, logs 16 and 18 and is killed
    without an end event; launch 3 resumes from 14 (16 and 18 are discarded, recomputed) and is done at 20.
    Metrics are logged every 2 steps, so every record stands for 2 steps."""
    rundir = RunDir(root)
    rundir.create()
    rundir.config.write_text("job:\n  name: three-launches\ntrain:\n  steps: 20\n  log_every: 2\n")
    a = [record(s, 1000 + s, "L1", 1.0, data=0.1) for s in (2, 4, 6, 8)]
    a.append(record(10, 1010, "L1", 1.0, data=0.1, ckpt=0.2))
    b_kept = [record(12, 1103, "L2", 1.5, data=0.15, **check(12, None, 1.0))]
    b_kept.append(record(14, 1106, "L2", 1.5, data=0.15, **check(14, 3, 2.07)))
    b_gone = [record(16, 1109, "L2", 1.5, data=0.15), record(18, 1112, "L2", 1.5, data=0.15, **check(18, 3, 2.5))]
    c = [record(16, 1202, "L3", 1.0, data=0.1), record(18, 1204, "L3", 1.0, data=0.1)]
    c.append(record(20, 1206, "L3", 1.0, data=0.1, ckpt=0.4, eval_loss=3.25, **check(20, 1, 1.6)))
    write_lines(rundir.metrics, a + b_kept + c, torn='{"step": 22, "lo')
    write_lines(rundir.metrics_discarded, b_gone)
    slurm = {"world_size": 4, "slurm_job_id": "100"}
    write_lines(
        rundir.history,
        [
            {"time": 1000, "event": EVENT_START, "step": 0, **slurm, "slurm_restart_count": 0, "launch": "L1"}
            | {"process_start": 990},
            {"time": 1012, "event": EVENT_STOPPED, "step": 10, "signal": 12, "launch": "L1"},
            {"time": 1100, "event": EVENT_RESUME, "step": 10, **slurm, "slurm_restart_count": 1, "launch": "L2"}
            | {"process_start": 1090},
            {"time": 1200, "event": EVENT_RESUME, "step": 14, "world_size": 4, "slurm_job_id": "101"}
            | {"slurm_restart_count": 0, "launch": "L3", "process_start": 1195},
            {"time": 1210, "event": EVENT_DONE, "step": 20, "launch": "L3"},
        ],
        torn='{"time": 12',
    )
    summary = {"final_step": 20, "final_loss": 3.0, "final_eval_loss": 3.25, "tokens_seen": 81920, "world_size": 4}
    rundir.summary.write_text(json.dumps(summary | {"wall_time_s": 40.0, "topology": "2 nodes x 2"}))
    return rundir


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_three_launches_goodput_lost_time_and_launch_table(tmp_path, capsys):
    rundir = make_three_launch_run(tmp_path / "run")
    assert report_main(str(rundir.root)) == 0
    out = capsys.readouterr().out
    log = analyze(rundir)
    acc = log.accounting

    # Launch walls, from process_start to the end event, or (launch 2, killed) to its last record, discarded too.
    assert [x.launch_id for x in log.launches] == ["L1", "L2", "L3"]
    assert [x.wall_s for x in log.launches] == [1012 - 990, 1112 - 1090, 1210 - 1195]
    # Step time of all records of a launch, each standing for 2 steps: 5 x 2 x 1.0, 4 x 2 x 1.5, 3 x 2 x 1.0.
    assert [x.step_time_s for x in log.launches] == pytest.approx([10.0, 12.0, 6.0])
    assert [x.startup_teardown_s for x in log.launches] == pytest.approx([12.0, 10.0, 9.0])
    assert [(x.start_step, x.last_step) for x in log.launches] == [(0, 10), (10, 18), (14, 20)]
    assert [(x.kept_steps, x.discarded_steps) for x in log.launches] == [(10, 0), (4, 4), (6, 0)]
    assert [x.ended for x in log.launches] == ["stopped (SIGUSR2)", "killed (no end event)", "done"]
    assert log.restarts == 2

    assert acc.total_wall_s == pytest.approx(22 + 22 + 15)
    assert acc.startup_teardown_s == pytest.approx(12 + 10 + 9)
    assert acc.recomputed_s == pytest.approx(2 * 2 * 1.5)  # steps 16 and 18 of launch 2
    assert acc.checkpoint_s == pytest.approx(2 * 0.2 + 2 * 0.4)
    assert acc.data_wait_s == pytest.approx(5 * 2 * 0.1 + 2 * 2 * 0.15 + 3 * 2 * 0.1)
    kept_step_time = 10.0 + 2 * 2 * 1.5 + 6.0
    assert acc.productive_s == pytest.approx(kept_step_time - 1.2 - 2.2)
    assert acc.goodput == pytest.approx(18.6 / 59)
    assert acc.other_s == pytest.approx(0.0, abs=1e-9)
    assert sum(s for _, s in acc.rows()) == pytest.approx(acc.total_wall_s)
    assert acc.between_launches_s == pytest.approx((1090 - 1012) + (1195 - 1112))

    st = log.stragglers
    assert (st.checks, st.flagged_checks, st.detections) == (4, 3, 3)
    assert sorted(st.by_rank) == [1, 3]
    assert st.by_rank[3]["count"] == 2 and st.by_rank[3]["host"] == "n1"
    assert st.worst["rank"] == 3 and st.worst["ratio"] == 2.5 and st.worst["step"] == 18

    md = (rundir.root / "report" / "report.md").read_text()
    assert "# Run report: three-launches" in md
    assert "| 1 | L1 | 100 (restart 0) | start | 4 | 0 → 10 | 22.0 s | 10.0 s | 12.0 s | 0 | stopped (SIGUSR2) |" in md
    assert (
        "| 2 | L2 | 100 (restart 1) | resume | 4 | 10 → 18 | 22.0 s | 12.0 s | 10.0 s | 4 | killed (no end event) |"
        in md
    )
    assert "| 3 | L3 | 101 (restart 0) | resume | 4 | 14 → 20 | 15.0 s | 6.0 s | 9.0 s | 0 | done |" in md
    assert "= **31.5 %**" in md
    assert "| recomputed steps | 6.0 s | 6.0 | 10.2 % |" in md
    assert "| evaluation | 0.0 s | 0.0 | 0.0 % |" in md and "| other | 0.0 s | 0.0 | 0.0 % |" in md
    assert "| final loss | 3.0000 |" in md and "| restarts | 2 |" in md
    assert "worst ratio 2.50 (rank 3 on n1 at step 18)" in md
    assert "Not in the wall time: queued between launches: 2m 41s." in md

    pngs = ["loss.png", "throughput.png", "step_time.png", "ranks.png", "wall.png"]
    for name in pngs:
        path = rundir.root / "report" / name
        width, height = png_size(path)
        assert width >= 800 and height >= 300, name
        assert path.stat().st_size > 10_000, name
        assert f"]({name})" in md
    assert (rundir.root / "report").stat().st_mode & 0o777 == 0o700

    assert f"report: {rundir.root / 'report' / 'report.md'}" in out
    assert "final loss 3.0000, eval loss 3.2500 at step 20/20" in out
    assert "goodput 31.5% of 59.0 s wall" in out
    assert "restarts 2 (3 launches, 1 killed without an end event); 3 straggler detections" in out


def test_run_in_progress_without_summary(tmp_path):
    rundir = RunDir(tmp_path / "run")
    rundir.create()  # no config.yaml either: the report needs only the metrics
    write_lines(
        rundir.history,
        [{"time": 50.0, "event": EVENT_START, "step": 0, "world_size": 1, "launch": "L1", "process_start": 45.0}],
    )
    recs = [record(s, 50.0 + s, "L1", 1.0, data=0.25) for s in (1, 2, 3)]
    recs.append({"step": 3, "time": 53.5, "eval_loss": 4.5, "time_eval_s": 0.5, "launch": "L1"})  # eval only
    write_lines(rundir.metrics, recs)
    out = tmp_path / "elsewhere"
    md, log, facts = write_report(rundir.root, out)
    assert md == out / "report.md" and not (rundir.root / "report").exists()
    assert not facts["complete"] and facts["final_step"] == 3 and facts["final_loss"] == pytest.approx(4.7)
    assert facts["final_eval_loss"] == 4.5
    (launch,) = log.launches
    assert launch.ended == "no end event (running, or killed)"
    assert launch.wall_s == pytest.approx(53.5 - 45.0)
    assert log.accounting.productive_s == pytest.approx(3 * 0.75)
    assert log.accounting.eval_s == pytest.approx(0.5)  # not step time, and not start-up either
    assert log.accounting.startup_teardown_s == pytest.approx(8.5 - 3.0 - 0.5)
    assert log.accounting.other_s == pytest.approx(0.0, abs=1e-9)
    text = md.read_text()
    assert "in progress" in text and "No straggler checks" in text and "ranks.png" not in text
    for name in ("loss.png", "throughput.png", "step_time.png", "wall.png"):
        assert png_size(out / name)[0] > 0


def test_without_history_one_launch_from_step_zero_is_assumed(tmp_path):
    rundir = RunDir(tmp_path)
    write_lines(rundir.metrics, [record(s, 100.0 + s, "", 1.0, data=0.0) for s in (5, 10)])  # log_every 5
    log = analyze(rundir)
    (launch,) = log.launches
    assert launch.kind == "assumed" and launch.start == pytest.approx(100.0)  # first record's 5 steps of 1.0 s
    assert log.accounting.total_wall_s == pytest.approx(10.0)
    assert log.accounting.productive_s == pytest.approx(10.0)


def test_hang_event_ends_a_launch_and_records_without_launch_id_are_matched_by_time(tmp_path):
    rundir = RunDir(tmp_path)
    write_lines(
        rundir.history,
        [
            {"time": 10.0, "event": EVENT_START, "step": 0, "launch": "A"},
            {"time": 20.0, "event": EVENT_HANG, "step": 2, "launch": "A", "message": "rank 3 | stuck in all-reduce"},
            {"time": 30.0, "event": EVENT_RESUME, "step": 0, "launch": "B"},
            {"time": 40.0, "event": EVENT_DONE, "step": 3, "launch": "B"},
        ],
    )
    write_lines(rundir.metrics, [record(s, 30.0 + s, "", 2.0, data=0.0) for s in (1, 2, 3)])
    write_lines(rundir.metrics_discarded, [record(s, 10.0 + s, "", 2.0, data=0.0) for s in (1, 2)])
    log = analyze(rundir)
    assert [x.ended for x in log.launches] == ["hang: rank 3 | stuck in all-reduce", "done"]
    assert [(x.kept_steps, x.discarded_steps) for x in log.launches] == [(0, 2), (3, 0)]
    assert [x.startup_teardown_s for x in log.launches] == pytest.approx([10.0 - 4.0, 10.0 - 6.0])
    assert log.accounting.recomputed_s == pytest.approx(4.0)
    assert log.accounting.other_s == pytest.approx(0.0, abs=1e-9)


def test_bad_run_directories_exit_2_naming_the_file(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert report_main(str(missing)) == EXIT_USER_ERROR
    assert f"error: {missing} does not exist" in capsys.readouterr().err

    rundir = RunDir(tmp_path / "run")
    rundir.create()
    assert report_main(str(rundir.root)) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert f"{rundir.metrics} does not exist: the run has no metrics yet" in err

    rundir.metrics.write_text('{"step": 1, "lo')  # only a torn line
    assert report_main(str(rundir.root)) == EXIT_USER_ERROR
    assert f"{rundir.metrics} has no complete step record yet" in capsys.readouterr().err
    assert not (rundir.root / "report").exists()


def test_cli_wiring_and_lazy_imports(tmp_path):
    proc = run_cli(["-m", "hpc", "report", str(tmp_path / "nope")], timeout=60)
    assert proc.returncode == EXIT_USER_ERROR and "does not exist" in proc.stderr
    assert "report" in run_cli(["-m", "hpc", "--help"], timeout=60).stdout
    code = "import sys, hpc.report, hpc.verbs; print(sorted({'torch', 'matplotlib'} & set(sys.modules)))"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert imported.stdout.strip() == "[]", imported.stderr


def test_step_time_section_medians_and_comm_per_dimension():
    recs = [
        record(s, 100.0 + s, "L", 1.0 if s > 1 else 9.0, data=0.1, comm_by_dim={"tp": 0.07, "pp": 0.03})
        for s in range(1, 6)
    ]
    recs[2]["comm_by_dim"] = {"tp": "x", "pp": True}  # malformed values are left out, never a crash
    text = "\n".join(step_time_lines(recs))
    assert "median of 4 records after the first" in text  # step 1 (start-up, 9 s) left out
    assert "| exposed communication | 100.0 ms | 10.0 % |" in text
    assert "| &nbsp;&nbsp;of which `tp` | 70.0 ms | 7.0 % |" in text
    assert "| &nbsp;&nbsp;of which `pp` | 30.0 ms | 3.0 % |" in text
    assert "| **step** | 1000.0 ms | 100 % |" in text
    assert step_time_lines([]) == []
    plain = [record(s, 100.0 + s, "L", 1.0, data=0.1) for s in range(1, 4)]  # DDP before per-dimension records
    assert "of which" not in "\n".join(step_time_lines(plain))


# Runs a verb of ``python -m hpc`` as its command line does, then says whether torch was imported on the way.
VERB_THEN_CHECK_TORCH = """
import sys
from hpc.cli import main
rc = main(sys.argv[1:])
assert "torch" not in sys.modules, "python -m hpc " + sys.argv[1] + " imported torch"
sys.exit(rc)
"""


def test_runs_and_compare_do_not_import_torch(tmp_path):
    """The login-node verbs that read run directories stay torch-free (seconds of import on a login node), checked
    after they have run on two run directories, not just imported."""
    one = make_three_launch_run(tmp_path / "runs" / "one")
    two = make_three_launch_run(tmp_path / "runs" / "two")
    two.config.write_text(two.config.read_text().replace("steps: 20", "steps: 24"))
    listed = run_cli(["-c", VERB_THEN_CHECK_TORCH, "runs", str(tmp_path / "runs"), "--json"], timeout=120)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    rows = json.loads(listed.stdout)
    assert sorted((r["name"], r["steps"]) for r in rows) == [("one", 20), ("two", 24)], rows
    png = tmp_path / "compare.png"
    compared = run_cli(
        ["-c", VERB_THEN_CHECK_TORCH, "compare", str(one.root), str(two.root), "--out", str(png)], timeout=120
    )
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert "| train.steps | 20 | 24 |" in compared.stdout, compared.stdout
    assert png_size(png)[0] > 0
