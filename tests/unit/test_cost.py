"""What a run cost (hpc/cost.py): node- and GPU-hours from the launches or from Slurm's accounting, the time queued,
the price, the cost per million tokens, and the goodput split, in `hpc report`, `hpc runs` and `hpc compare`. The
same figures from a real sacct: tests/slurm/test_accounting.py; in the tracker: tests/mp/test_tracking.py."""

from __future__ import annotations

import json

import pytest

from hpc.cost import cost_of, from_allocations, program_goodput
from hpc.report import main as report_main
from hpc.runlog import analyze, config_dict
from hpc.slurmctl import Allocation
from runconfig import ConfigError, load_config
from tests.conftest import run_cli
from tests.unit.test_report import make_three_launch_run, write_lines

PRICED = "job:\n  name: three-launches\ntrain:\n  steps: 20\n  log_every: 2\ncost:\n  node_hour: 3.6\n"


def two_node_run(root, mfu: bool = False):
    """The report tests' three launches (walls 22, 22 and 15 s; 161 s between them), each on two nodes."""
    rundir = make_three_launch_run(root)
    rundir.config.write_text(PRICED)
    history = [json.loads(line) for line in rundir.history.read_text().splitlines() if line.endswith("}")]
    for e in history:
        if "world_size" in e:
            e["nodes"], e["device"] = ["n0", "n1"], "cpu"
    write_lines(rundir.history, history)
    if mfu:  # launch 1's records at 0.2 (2 s of step time each), the others at 0.5 (1.5 and 1 s each)
        records = [json.loads(line) for line in rundir.metrics.read_text().splitlines() if line.endswith("}")]
        for r in records:
            r["mfu"] = 0.2 if r["launch"] == "L1" else 0.5
        write_lines(rundir.metrics, records)
    return rundir


def test_the_launches_node_hours_price_and_goodput_split(tmp_path, capsys):
    rundir = two_node_run(tmp_path / "run")
    log = analyze(rundir)
    cost = cost_of(rundir, log, config_dict(rundir))
    u = cost.usage
    assert (u.source, u.why, u.allocations) == ("launches", "", 3)
    assert u.held_s == pytest.approx(59.0) and u.node_s == pytest.approx(2 * 59.0) and u.gpu_s == 0.0
    assert u.queued_s == pytest.approx((1090 - 1012) + (1195 - 1112))  # no jobs.jsonl: between launches only
    assert cost.total == pytest.approx(2 * 59 / 3600 * 3.6)
    assert cost.per_million == pytest.approx(cost.total / 0.08192)  # summary.json's 81,920 tokens seen
    s = cost.split
    assert s.scheduling == pytest.approx(59 / (59 + 161)) and s.runtime == pytest.approx(18.6 / 59)
    assert s.program is None and s.overall == pytest.approx(s.scheduling * s.runtime) and s.worst == "scheduling"

    assert report_main(str(rundir.root)) == 0
    out = capsys.readouterr().out
    assert "cost: 0.03278 node-hours, 0 GPU-hours (launches), 0.118 USD (1.44 USD per M tokens)" in out, out
    assert "goodput split: scheduling 26.8 %, runtime 31.5 %, program -; most lost to scheduling" in out
    md = (rundir.root / "report" / "report.md").read_text()
    assert "From the launches' wall time and shape (3 launch(es)); price: 3.6 USD a node-hour." in md
    assert "| node-hours | 0.03278 |" in md and "| cost per million tokens | 1.44 USD |" in md
    assert "| scheduling | 26.8 % |" in md and "The most was lost to **scheduling** (26.8 %)." in md
    assert "Program goodput is unknown" in md and "**Goodput split**" in md


def test_program_goodput_is_the_step_time_weighted_mfu(tmp_path):
    rundir = two_node_run(tmp_path / "run", mfu=True)
    log = analyze(rundir)
    # kept step time: L1 5 records x 2 steps x 1 s at 0.2; L2 2 x 2 x 1.5 and L3 3 x 2 x 1 at 0.5
    assert program_goodput(log) == pytest.approx((10 * 0.2 + 6 * 0.5 + 6 * 0.5) / 22)
    split = cost_of(rundir, log, config_dict(rundir)).split
    assert split.worst == "scheduling" and split.overall == pytest.approx(
        split.scheduling * split.runtime * split.program
    )


def test_gpu_hours_from_the_launches_on_gpus(tmp_path):
    rundir = two_node_run(tmp_path / "run")
    rundir.config.write_text(PRICED.replace("node_hour: 3.6", "gpu_hour: 2.5\n  currency: credits"))
    history = [json.loads(line) for line in rundir.history.read_text().splitlines()]
    write_lines(rundir.history, [e | {"device": "cuda"} if "world_size" in e else e for e in history])
    cost = cost_of(rundir, analyze(rundir), config_dict(rundir))
    assert cost.usage.gpu_s == pytest.approx(4 * 59.0)  # world 4, one GPU a rank
    assert cost.total == pytest.approx(4 * 59 / 3600 * 2.5) and cost.prices.currency == "credits"


def run(job, state, submit, start, end, eligible="submit", nodes=2, gpus=8):
    elapsed = (end - start) if start is not None and end is not None else 0
    eligible = submit if eligible == "submit" else eligible
    return Allocation(job, state, submit, eligible, start, end, elapsed, nodes, gpus)


def test_accounting_runs_requeues_and_a_pending_job():
    runs = [
        run("7", "COMPLETED", submit=0, start=460, end=760),  # sacct's order is not trusted: sorted by start
        run("7", "REQUEUED", submit=0, start=100, end=400),
        run("8", "PENDING", submit=900, start=None, end=None, gpus=0),
    ]
    u = from_allocations(runs, now=1000)
    assert (u.source, u.allocations, u.held_s, u.node_s, u.gpu_s) == ("sacct", 3, 600, 1200, 4800)
    assert u.queued_s == pytest.approx(100 + (460 - 400) + (1000 - 900))  # a requeue waits from the run's end


def test_a_chains_links_wait_from_their_dependency_not_their_submission():
    """`--chain 3` submits every link at once; each can start only when the one before ended (Eligible)."""
    links = [
        run("10", "COMPLETED", submit=0, start=60, end=86_460),
        run("11", "COMPLETED", submit=0, eligible=86_460, start=86_520, end=172_920),
        run("12", "PENDING", submit=0, eligible=None, start=None, end=None),  # its dependency not met yet
    ]
    u = from_allocations(links, now=100_000)
    assert u.queued_s == pytest.approx(60 + 60)  # not a day and more for each later link


def test_a_restart_in_the_job_holds_the_allocation_and_an_unknown_device_is_unknown(tmp_path):
    rundir = two_node_run(tmp_path / "run")
    history = [json.loads(line) for line in rundir.history.read_text().splitlines()]
    for e in history:  # launch 2 was restarted in the same run of job 100 after it was killed, not requeued
        if e.get("launch") == "L2" and "slurm_restart_count" in e:
            e["slurm_restart_count"] = 0
    write_lines(rundir.history, history)
    rundir.config.write_text(PRICED.replace("node_hour: 3.6", "gpu_hour: 2.5"))
    cost = cost_of(rundir, analyze(rundir), config_dict(rundir))
    # L1 stopped by its signal and L2 in the same run of job 100: neither queued (no new job or run of it) nor held
    # (L1 did not fail). L2 killed, then L3 in job 101: queued.
    assert cost.usage.queued_s == pytest.approx(83) and cost.usage.held_s == pytest.approx(59)
    history[1] = {k: v for k, v in history[1].items()} | {"event": "hang"}  # L1 ends in a hang: restarted in the job
    write_lines(rundir.history, history)
    cost = cost_of(rundir, analyze(rundir), config_dict(rundir))
    assert cost.usage.queued_s == pytest.approx(83) and cost.usage.held_s == pytest.approx(59 + 78)
    # the start events name no device (recorded before they did): GPU-hours unknown, no cost by the GPU-hour
    write_lines(rundir.history, [{k: v for k, v in e.items() if k != "device"} for e in history])
    cost = cost_of(rundir, analyze(rundir), config_dict(rundir))
    assert cost.usage.gpu_hours is None and cost.total is None
    assert report_main(str(rundir.root)) == 0
    assert "GPU-hours are unknown" in (rundir.root / "report" / "report.md").read_text()


def test_runs_and_compare_show_the_cost(tmp_path):
    one, two = two_node_run(tmp_path / "runs" / "one"), two_node_run(tmp_path / "runs" / "two")
    two.config.write_text(PRICED.replace("3.6", "7.2"))
    listed = run_cli(["-m", "hpc", "runs", str(tmp_path / "runs"), "--json", "--sort", "cost"], timeout=120)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    rows = json.loads(listed.stdout)
    assert [r["name"] for r in rows] == ["one", "two"]
    assert [r["cost"] for r in rows] == pytest.approx([2 * 59 / 3600 * 3.6, 2 * 59 / 3600 * 7.2])
    assert rows[0]["node_hours"] == pytest.approx(2 * 59 / 3600) and rows[0]["queued_s"] == pytest.approx(161)
    assert rows[0]["cost_source"] == "launches" and rows[0]["cost_per_m"] == pytest.approx(rows[0]["cost"] / 0.08192)
    compared = run_cli(
        ["-m", "hpc", "compare", str(one.root), str(two.root), "--out", str(tmp_path / "c.png")], timeout=120
    )
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert "| 0.0328 | 0 | 0.118 USD | 1.44 USD |" in compared.stdout, compared.stdout
    assert "| 0.0328 | 0 | 0.236 USD | 2.88 USD |" in compared.stdout
    assert "| cost.node_hour | 3.6 | 7.2 |" in compared.stdout


@pytest.mark.parametrize(
    ("sets", "key", "words"),
    [
        (["cost.node_hour=2", "cost.gpu_hour=1"], "cost.gpu_hour", "price the run by one of them"),
        (["cost.node_hour=-1"], "cost.node_hour", "must be >= 0"),
        (["cost.currency=U S D"], "cost.currency", "at most 16"),
    ],
)
def test_bad_prices_are_refused_by_key(sets, key, words):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", sets)
    assert key in str(info.value) and words in str(info.value)
