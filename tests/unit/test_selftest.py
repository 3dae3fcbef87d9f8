"""The pure parts of the signal-path self-test and the preemption budget: the lead-time rule, the process chain read
from /proc, the self-test's verdict and report from what a job showed, the trainer's per-launch estimate, the
warnings of status and report, and job.launch_prefix on the launchers' command lines."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc.driver import srun_command
from hpc.local import trainer_command
from hpc.report import facts, markdown, summary_lines
from hpc.runlog import analyze
from hpc.selftest import Observed, assess, exit_status, render, summary
from hpc.status import print_status, status
from runconfig import ConfigError, dump_yaml, load_config
from rundir import RunDir
from rundir.contract import (
    EVENT_START,
    EVENT_STOPPED,
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_LEAD_SHORT,
    append_event,
    rank_ranges,
)
from rundir.stopsignal import (
    SAFETY_FACTOR,
    LeadBudget,
    estimate,
    newest_budget,
    process_chain,
    signal_state,
    wrappers,
)
from trainer.loop.stopreport import LeadCheck


def test_the_lead_must_cover_a_stop_with_the_safety_margin():
    assert SAFETY_FACTOR == 2.0
    ok = LeadBudget(lead_s=120, needed_s=60, measured=True)
    assert ok.ok and ok.covered and "covers a stop with margin" in ok.describe()
    short = LeadBudget(lead_s=120, needed_s=61, measured=True)
    assert not short.ok and short.covered and short.required_s == 122
    assert "too short" in short.describe() and "not with the margin of x2" in short.describe()
    uncovered = LeadBudget(lead_s=30, needed_s=45.2, measured=True)
    assert not uncovered.covered and uncovered.required_s == 91 and "shorter than that" in uncovered.describe()
    assert LeadBudget(lead_s=60, needed_s=0.1, measured=True).required_s == 10  # Slurm's and the config's minimum
    guess = estimate(lead_s=10, step_s=2.0, save_s=4.5)
    assert guess.needed_s == 6.5 and not guess.measured and not guess.ok
    assert "would take about 6.5 s (a step and the newest checkpoint's save)" in guess.describe()
    assert guess.fields() == {"lead_s": 10, "needed_s": 6.5, "measured": False, "ok": False}


STATUS = "Name:\tpython\nSigQ:\t0/1\nSigPnd:\t0000000000000000\nSigBlk:\t{blk}\nSigIgn:\t{ign}\nSigCgt:\t{cgt}\n"


def mask(*signums: int) -> str:
    return f"{sum(1 << (s - 1) for s in signums):016x}"


def test_signal_state_reads_the_masks_of_proc_status():
    text = STATUS.format(blk=mask(signal.SIGUSR2), ign=mask(signal.SIGUSR1), cgt=mask(signal.SIGTERM, signal.SIGINT))
    state = signal_state(text, ["SIGUSR1", "SIGUSR2", "SIGTERM"])
    assert state == {"blocked": ["SIGUSR2"], "ignored": ["SIGUSR1"], "caught": ["SIGTERM"]}


def fake_proc(root: Path, procs: list[tuple[int, int, str, list[str], str]]) -> Path:
    """(pid, ppid, comm, argv, SigBlk) -> /proc/PID/{stat,cmdline,status}."""
    for pid, ppid, comm, argv, blk in procs:
        d = root / str(pid)
        d.mkdir(parents=True)
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560\n")
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (d / "status").write_text(STATUS.format(blk=blk, ign=mask(), cgt=mask()))
    return root


def test_the_process_chain_goes_up_to_slurmstepd_and_names_the_wrappers(tmp_path):
    usr2 = mask(signal.SIGUSR2)
    proc = fake_proc(
        tmp_path,
        [
            (40, 30, "python", ["python", "-u", "-m", "trainer", "--run-dir", "/runs/a"], usr2),
            (30, 20, "python", ["python", "swallow.py", "SIGUSR2", "python", "-u", "-m", "trainer"], usr2),
            (20, 10, "slurmstepd", ["slurmstepd: [7.0]"], mask()),
            (10, 1, "slurmd", ["/usr/sbin/slurmd", "-N", "n1"], mask()),
        ],
    )
    chain = process_chain(["SIGUSR2", "SIGTERM"], pid=40, proc=proc)
    assert [p["pid"] for p in chain] == [40, 30, 20]  # up to and with slurmstepd, nothing above it
    assert chain[0]["blocked"] == ["SIGUSR2"] and chain[1]["cmdline"][1] == "swallow.py"
    assert [p["pid"] for p in wrappers(chain)] == [30]
    # A process name with spaces and parentheses (the stat line is split at its last ")").
    fake_proc(tmp_path / "odd", [(5, 1, "a (b) c", ["x"], mask())])
    assert process_chain([], pid=5, proc=tmp_path / "odd")[0]["name"] == "a (b) c"


def test_a_chain_without_slurmstepd_keeps_only_the_rank_and_two_ancestors(tmp_path):
    procs = [(9 - i, 8 - i, f"p{i}", [f"cmd{i}", "--secret=x"], mask()) for i in range(8)]
    chain = process_chain([], pid=9, proc=fake_proc(tmp_path, procs))
    assert [p["pid"] for p in chain] == [9, 8, 7] and wrappers(chain) == []


def record(rank: int, *, wrapper: list[str] | None = None, blocked: bool = False) -> dict:
    block = ["SIGUSR2"] if blocked else []
    chain = [{"pid": 100 + rank, "name": "python", "cmdline": ["python", "-m", "trainer"], "blocked": block}]
    if wrapper:
        chain.append({"pid": 200 + rank, "name": "python", "cmdline": wrapper, "blocked": block})
    chain.append({"pid": 300 + rank, "name": "slurmstepd", "cmdline": ["slurmstepd: [3.0]"], "blocked": []})
    return {"rank": rank, "blocked": block, "chain": chain}


def observed(**kw) -> Observed:
    base = {
        "signal": "SIGUSR2",
        "lead_s": 120,
        "world_size": 4,
        "run_dir": "/runs/selftest-tiny",
        "job_id": "7",
        "sbatch_signal": "USR2@120",
        "started": True,
        "records": {r: record(r) for r in range(4)},
    }
    return Observed(**{**base, **kw})


def stopped(received: dict, learned: list[int], needed: float = 3.5) -> dict:
    return {
        "event": EVENT_STOPPED,
        "received": received,
        "learned": learned,
        "stop_s": 0.5,
        "save_s": 2.5,
        "signal_to_commit_s": needed,
    }


def test_every_rank_received_it_and_the_lead_covers_it():
    obs = observed(stopped=stopped({"SIGUSR2": [0, 1, 2, 3]}, []), stopped_within_lead=True)
    checks = assess(obs)
    assert [(c.level, c.what) for c in checks] == [
        ("PASS", "sbatch"), ("PASS", "signal"), ("PASS", "stop"), ("PASS", "lead"),
    ]  # fmt: skip
    assert exit_status(checks) == EXIT_DONE
    text = render(obs, checks)
    assert (
        text.splitlines()[0]
        == "selftest of SIGUSR2 (lead 120 s) on 4 ranks, Slurm job 7; run directory /runs/selftest-tiny"
    )
    assert "PASS signal: all 4 ranks received SIGUSR2 themselves" in text
    assert "PASS stop: 0.50 s from the signal to every rank agreeing at a step boundary, 2.50 s to save" in text
    assert text.splitlines()[-1] == "selftest: all good (exit status 0)"
    out = summary(obs, checks)
    assert out["status"] == 0 and out["received"] == [0, 1, 2, 3] and out["missing"] == []
    assert out["signal_to_commit_s"] == 3.5 and out["required_lead_s"] == 10 and out["wrappers"]["0"] == []
    json.dumps(out)


def test_a_lead_shorter_than_twice_the_stop_is_exit_status_4():
    obs = observed(lead_s=60, stopped=stopped({"SIGUSR2": [0, 1, 2, 3]}, [], needed=40.0))
    checks = assess(obs)
    assert checks[-1].level == "FAIL" and checks[-1].what == "lead" and "at least 80" in checks[-1].message
    assert exit_status(checks) == EXIT_LEAD_SHORT
    assert render(obs, checks).splitlines()[-1] == "selftest: the lead time is too short (exit status 4)"


def test_ranks_behind_a_swallowing_wrapper_are_named_once_per_kind():
    wrapper = ["python", "tests/slurm/workers/swallow_signal.py", "SIGUSR2", "python", "-m", "trainer"]
    records = {r: record(r, wrapper=wrapper if r >= 2 else None, blocked=r >= 2) for r in range(4)}
    obs = observed(records=records, stopped=stopped({"SIGUSR2": [0, 1]}, [2, 3]))
    checks = assess(obs)
    fails = [c.message for c in checks if c.level == "FAIL"]
    assert fails[0] == "2 of 4 ranks did not receive SIGUSR2 (the others stopped them)"
    assert fails[1] == (
        "ranks 2-3: the rank's process had SIGUSR2 blocked since it started (inherited from its parent); between "
        "slurmstepd and the rank: `python tests/slurm/workers/swallow_signal.py SIGUSR2 python -m trainer` "
        "(blocks SIGUSR2)"
    )
    assert not any(c.what == "lead" for c in checks)  # not measured for a broken path
    assert exit_status(checks) == EXIT_FAILED
    assert summary(obs, checks)["missing"] == [2, 3]


def test_no_stop_at_all_and_a_rank_without_a_record():
    records = {r: record(r) for r in range(3)}
    obs = observed(records=records, stopped=None)
    fails = [c.message for c in assess(obs) if c.level == "FAIL"]
    assert fails == [
        "no rank stopped within job.signal_lead_s=120 s of SIGUSR2",
        "ranks 0-2: no process between slurmstepd and the rank",
        "rank 3: no signal record (the rank did not start, or could not write logs/)",
    ]


def test_the_script_and_the_config_are_checked_too():
    batch = assess(observed(sbatch_signal="B:USR2@120", stopped=stopped({"SIGUSR2": [0, 1, 2, 3]}, [])))
    assert batch[0].level == "FAIL" and "batch shell only" in batch[0].message and exit_status(batch) == EXIT_FAILED
    none = assess(observed(sbatch_signal=None, started=False, notes=["job 7 is PENDING after --timeout 60 s"]))
    assert [c.level for c in none] == ["FAIL", "FAIL"] and none[1].message.endswith(
        "job 7 is PENDING after --timeout 60 s"
    )
    usr1 = observed(
        signal="SIGUSR1", sbatch_signal="USR1@120", nccl=True, stopped=stopped({"SIGUSR1": [0, 1, 2, 3]}, [])
    )
    checks = assess(usr1)
    assert [c.level for c in checks if c.what == "nccl"] == ["WARN"] and exit_status(checks) == EXIT_DONE


def test_rank_ranges():
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and rank_ranges([3]) == "3" and rank_ranges([]) == ""


def make_run(root: Path, lead_s: int = 120) -> RunDir:
    rundir = RunDir(root)
    rundir.create()
    rundir.config.write_text(dump_yaml(load_config("tiny", [f"job.signal_lead_s={lead_s}"])))
    return rundir


def test_status_and_report_warn_when_the_newest_figure_says_the_lead_is_too_short(tmp_path, capsys):
    rundir = make_run(tmp_path / "run")
    t = time.time()
    append_event(rundir.history, EVENT_START, step=0, launch="a", world_size=4)
    rundir.metrics.write_text(
        "".join(
            json.dumps({"step": s, "loss": 4.0, "step_time_s": 1.0, "time": t + s, "launch": "a"}) + "\n"
            for s in (1, 2)
        )
    )
    assert newest_budget(rundir) is None and status(rundir)["stop_lead"] is None
    # rank 0's estimate (a step and a save), then a measured stop that took longer: the newer figure counts
    rundir.stop_budget.write_text(json.dumps({**estimate(120, 1.0, 9.0).fields(), "time": t}))
    assert newest_budget(rundir).ok
    append_event(rundir.history, EVENT_STOPPED, step=2, launch="a", signal=12, signal_to_commit_s=75.0, lead_s=120)
    budget = newest_budget(rundir)
    assert budget.measured and budget.needed_s == 75.0 and not budget.ok
    assert newest_budget(rundir, lead_s=300).ok  # against the config's lead now (a resume may have raised it)

    info = status(rundir)
    assert info["stop_lead"]["ok"] is False and info["stop_lead"]["needed_s"] == 75.0
    print_status(info)
    out = capsys.readouterr().out
    assert "  stop signal lead: 120 s for a stop of 75.0 s (measured): too short" in out
    assert "  warning: job.signal_lead_s=120 is too short: a stop took 75.0 s" in out

    log = analyze(rundir)
    f = facts(log, {"job": {"signal_lead_s": 120}})
    assert summary_lines(log, f)[-1].startswith("warning: job.signal_lead_s=120 is too short")
    md = markdown(log, f, [])
    assert "| stop signal lead | 120 s for a stop of 75.0 s (measured at a stop): **too short** |" in md
    assert "**Warning:** job.signal_lead_s=120 is too short" in md
    assert not summary_lines(log, facts(log, {"job": {"signal_lead_s": 150}}))[-1].startswith("warning")


def test_the_trainer_estimates_once_per_launch_and_warns_once_when_short(tmp_path, caplog):
    rundir = make_run(tmp_path / "run")
    check = LeadCheck(30, rundir, SimpleNamespace(rank=0, launch_id="L1"))
    assert check.after_save(10, 1.0, None) is None and not rundir.stop_budget.exists()  # no save figure yet
    assert check.after_save(10, 1.0, 4.0).ok
    first = json.loads(rundir.stop_budget.read_text())
    assert first["step"] == 10 and first["needed_s"] == 5.0 and first["launch"] == "L1" and first["ok"]
    check.after_save(20, 1.0, 5.0)  # still ok: recorded once only
    assert json.loads(rundir.stop_budget.read_text()) == first and not caplog.records
    short = check.after_save(30, 2.0, 14.0)  # 2 x 16 s > 30 s
    assert not short.ok and json.loads(rundir.stop_budget.read_text())["step"] == 30
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "raise job.signal_lead_s" in caplog.text.lower()
    assert check.after_save(40, 2.0, 20.0) is None and len(caplog.records) == 1  # warned once per launch
    other = LeadCheck(30, rundir, SimpleNamespace(rank=1, launch_id="L1"))
    assert other.after_save(10, 2.0, 20.0) is None  # rank 0 alone


def test_job_launch_prefix_goes_before_the_interpreter_for_srun_and_mpirun():
    cfg = load_config("tiny", ["job.launch_prefix=[apptainer, exec, --nv, image.sif]", "job.mpi=pmi2"])
    rundir = RunDir(Path("/runs/x"))
    expected = ["apptainer", "exec", "--nv", "image.sif", sys.executable, "-u", "-m", "trainer", "--run-dir", "/runs/x"]
    assert trainer_command(rundir, cfg.job.launch_prefix) == expected
    assert srun_command(cfg, rundir)[-len(expected) :] == expected
    assert trainer_command(rundir) == expected[4:]


def test_launch_prefix_words_carry_no_shell_characters():
    for bad in ('"a b"', '"$(id)"', '"x;rm"', '""', '"`id`"'):
        with pytest.raises(ConfigError, match=r"job.launch_prefix\[1\].*one word"):
            load_config("tiny", [f"job.launch_prefix=[env, {bad}]"])
