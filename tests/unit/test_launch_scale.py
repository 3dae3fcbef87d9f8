"""The launch side at 4,096 ranks (512 nodes x 8), on a run directory of the true shape, each mechanism timed.

The run directory is built once for the module (under 1 s), with the package's own writers where the records
are the launchers' (RunDir.create, append_event, write_submission, RunDir.write_failure, checkpoints.commit,
decide_after_launch + record_decision): ten launches of history (the first with the gang preflight's every node and
link, each stop with the 4,096 ranks that got the signal), a node lost in the ninth and named bad, and one
checkpoint generation of two files per rank. Left out: every rank's log and signal record (8,192 files that nothing
here reads: `hpc logs --all` and `hpc selftest` do), and the run's Slurm jobs (`hpc status` would ask the local
cluster about them, and that answer is not this module's).

What is pinned, each on that input: the driver's reading of srun's failed-task lines and task ranges, and its end
of a step whose lost node's tasks never report; the bad-node records; the diagnosis that names 2,048 silent ranks'
256 nodes, and their recording (once each); the launchers' usable nodes without them; `hpc status` in process and as
a command; the report's analysis. Each is right, and each stays under a bound of CPU seconds (the wall clock of a
loaded machine once stretched 0.07 s of status to 1.9 s; the step's end alone is wall-clock): 10-100x what it took
(at least 0.1 s; the command: 3 s, its interpreter included), and below what a cost growing with nodes x history
takes here: the driver re-reading history.jsonl for each node of the allocation (512 reads of this history: 1.1 s),
record_decision re-reading it for each node it names (256: 0.5 s).
The report's figures (seconds, the per-rank one above all) and the trainer's watchdog on a real store are
bench/scale.py's; `hpc report` as a command draws every figure (2-3 s here), so only its analysis is timed.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from hpc import driver as drv
from hpc.policy.badnodes import bad_node_events, bad_nodes, due_back, node_changes, usable_nodes
from hpc.policy.decide import Situation, decide_after_launch, named_nodes, record_decision
from hpc.policy.outcome import Ended, how_it_ended
from hpc.report import facts, markdown, summary_lines
from hpc.runlog import analyze
from hpc.status import status
from runconfig import RunConfig, dump_yaml, load_config
from rundir import RunDir
from rundir.checkpoints import commit, latest_committed, step_name
from rundir.contract import (
    EVENT_BAD_NODE,
    EVENT_CODE,
    EVENT_DONE,
    EVENT_PREFLIGHT,
    EVENT_RESTART,
    EVENT_RESUME,
    EVENT_START,
    EVENT_STOPPED,
    FAILURE_CRASH,
    append_event,
)
from rundir.paths import read_jsonl
from rundir.record import command_line, write_json, write_submission
from storage.files import write_json_atomic
from tests.conftest import run_cli

NODES, RPN = 512, 8
WORLD = NODES * RPN
NAMES = [f"node{i:04d}" for i in range(NODES)]
LAUNCHES = 10  # L1 starts, L2..L8 resume after a stop each, L9 loses LOST, L10 (a new job without it) finishes
LOST = 17
STEPS, PER_LAUNCH, CHECKPOINT = 2000, 200, 1700  # L9 trains 1600..1800 and is lost after its checkpoint at 1700
SILENT = range(WORLD // 2, WORLD)  # half the ranks silent: the nodes of the second half


@dataclass(frozen=True)
class Big:
    rundir: RunDir
    cfg: RunConfig
    last_nodes: tuple[str, ...]  # L10's nodes: all but LOST, and a replacement


def cpu_seconds() -> float:
    """CPU seconds used so far by this thread and this process's ended children: unlike the wall clock, not
    stretched by the other processes of a loaded machine (the suite's other worker, its launches), nor by the other
    threads of this worker (a session fixture's server)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.thread_time() + children.ru_utime + children.ru_stime


def timed(fn, clock=cpu_seconds, best_of: int = 1):
    """(fn's result, the CPU seconds it took; with clock=time.perf_counter, the wall-clock seconds). A read-only fn
    is timed best_of times and the fastest counts: a bound is on the work done, not on a moment of a noisy VM."""
    best = float("inf")
    for _ in range(best_of):
        started = clock()
        out = fn()
        best = min(best, clock() - started)
    return out, best


def within(seconds: float, bound: float, what: str) -> None:
    assert seconds < bound, f"{what} took {seconds:.3f} s at {WORLD} ranks (bound {bound} s)"


def suspect(rank: int, nodes: list[str] | tuple[str, ...], why: str) -> dict:
    """trainer/env.py RuntimeEnv.suspect's shape."""
    return {"rank": rank, "node": nodes[rank // RPN], "node_index": rank // RPN, "why": why}


def metrics_record(step: int, t: float, launch: str) -> dict:
    r = {"step": step, "loss": 5.0 - step / 1000, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e6,
         "samples_per_s": 500.0, "step_time_s": 0.5, "tokens_seen": step * 1_000_000, "time": t, "launch": launch,
         "time_data_s": 0.01, "time_compute_s": 0.4, "time_comm_s": 0.05, "time_optim_s": 0.03}  # fmt: skip
    if step % 50 == 0:  # a straggler check: every rank's busy time (trainer/observe/stragglers.py)
        times = [0.45 + (i % 7) * 0.001 for i in range(WORLD)]
        times[137] = 0.7
        r["rank_step_time_s"] = times
        r["stragglers"] = [{"rank": 137, "host": NAMES[137 // RPN], "node": 137 // RPN, "step_time_s": 0.7,
                            "ratio": 1.55}]  # fmt: skip
        r["straggler_nodes"] = []
    return r


def launch_started(rundir: RunDir, k: int, step: int, nodes: list[str], t0: float) -> None:
    append_event(rundir.history, EVENT_START if k == 1 else EVENT_RESUME, step=step, world_size=len(nodes) * RPN,
                 nodes=nodes, grad_accum=1, slurm_job_id=str(1000 + k), slurm_restart_count=0, launch=f"L{k}",
                 process_start=t0 + k * 1000, startup_s={"imports": 5.0}, peak_mem_mb={"startup": 1000.0},
                 recipe="gpt", code_sha256="0" * 64)  # fmt: skip
    node_facts = {n: {"host": n, "cpu": "x", "cpus_per_rank": 8, "memory_kb": 1 << 30, "kernel": "6",
                      "ranks": list(range(i * RPN, (i + 1) * RPN)), "gpus": []}
                  for i, n in enumerate(nodes)}  # fmt: skip
    write_json(
        rundir.record / f"launch-{k - 1:03d}.json",
        {"launch": f"L{k}", "world_size": len(nodes) * RPN, "nodes": node_facts, "packages": [], "environment": {}},
    )


def build(root: Path) -> Big:
    rundir = RunDir(root)
    rundir.create()
    overrides = [f"job.nodes={NODES}", f"job.ranks_per_node={RPN}", "job.max_failures=5", f"train.steps={STEPS}",
                 "train.log_every=10", f"train.global_batch_size={8 * WORLD}"]  # fmt: skip
    cfg = load_config("tiny", overrides)
    rundir.config.write_text(dump_yaml(cfg))
    write_submission(rundir.record, command_line("hpc.submit", ["tiny"]), resumed=False, project_source=None)
    append_event(rundir.history, EVENT_CODE, module="tiny", sha256="0" * 64, source="x")

    t0 = time.time() - 20_000
    metrics, discarded = [], []
    for k in range(1, LAUNCHES):  # L1..L8 stop with a committed checkpoint; L9 loses a node
        step = (k - 1) * PER_LAUNCH
        launch_started(rundir, k, step, NAMES, t0)
        if k == 1:
            append_event(rundir.history, EVENT_PREFLIGHT, launch="L1", mode="warn", seconds=3.0, margin=0.5,
                         mib=64.0, measured=NODES,
                         nodes=[{"node": i, "name": n, "intra_gbps": 100.0, "link_gbps": 20.0, "compute_gflops": 1e4,
                                 "mem_free_gb": 70.0} for i, n in enumerate(NAMES)],
                         links=[{"from": i, "to": (i + 1) % NODES, "gbps": 20.0} for i in range(NODES)],
                         named=[], action=None, unreadable=[], skipped=[])  # fmt: skip
        for s in range(step + 10, step + PER_LAUNCH + 1, 10):
            record = metrics_record(s, t0 + k * 1000 + 30 + (s - step) * 0.5, f"L{k}")
            (discarded if k == LAUNCHES - 1 and s > CHECKPOINT else metrics).append(record)
        if k < LAUNCHES - 1:
            append_event(rundir.history, EVENT_STOPPED, step=step + PER_LAUNCH, launch=f"L{k}", signal=12,
                         received={"SIGUSR2": list(range(WORLD))}, learned=[], save_s=10.0, lead_s=120.0,
                         stop_s=1.0, signal_to_commit_s=11.0, arrival_spread_s=0.1)  # fmt: skip
    lost = range(LOST * RPN, (LOST + 1) * RPN)
    rundir.write_failure(0, f"rank(s) {', '.join(map(str, lost))} did not answer", FAILURE_CRASH,
                         [suspect(r, NAMES, "did not answer the roll call") for r in lost])  # fmt: skip
    situation = Situation(slurm=True, nodes=tuple(NAMES), launch_nodes=tuple(NAMES), ranks_per_node=RPN)
    decision = decide_after_launch(rundir, cfg.job, Ended("failed", 1), situation)
    assert decision.action == "resubmit" and decision.exclude == (NAMES[LOST],), decision
    record_decision(rundir, decision, failed_launch=f"L{LAUNCHES - 1}", status=1)
    # L10: a new job without the lost node (on a replacement), from the checkpoint at CHECKPOINT to the end
    rundir.clear_failure()  # the driver's, before each launch
    last = [n for n in NAMES if n != NAMES[LOST]] + [f"node{NODES:04d}"]
    launch_started(rundir, LAUNCHES, CHECKPOINT, last, t0)
    for s in range(CHECKPOINT + 10, STEPS + 1, 10):
        metrics.append(metrics_record(s, t0 + LAUNCHES * 1000 + 30 + (s - CHECKPOINT) * 0.5, f"L{LAUNCHES}"))
    append_event(rundir.history, EVENT_DONE, step=STEPS, launch=f"L{LAUNCHES}")
    rundir.metrics.write_text("".join(json.dumps(m) + "\n" for m in metrics))
    rundir.metrics_discarded.write_text("".join(json.dumps(m) + "\n" for m in discarded))
    rundir.summary.write_text(json.dumps({"final_step": STEPS, "final_loss": 3.0, "world_size": WORLD,
                                          "topology": {"nodes": NODES, "ranks_per_node": RPN}}))  # fmt: skip
    write_json_atomic(rundir.stop_budget, {"time": t0 + 15_000, "needed_s": 11.0, "lead_s": 120.0,
                                           "measured": False, "ok": True}, fsync=False)  # fmt: skip

    # one checkpoint generation: rank_NNNNN.pt and dcp/__R_0.distcp per rank (trainer/checkpoint/writer.py), each a
    # hard link to one small file (a new file each costs 10x more on a busy disk; status stats them, no more)
    blob = root.parent / "blob"
    blob.write_bytes(b"x" * 64)
    entry = {"size": 64, "sha256": hashlib.sha256(blob.read_bytes()).hexdigest()}
    tmp = rundir.checkpoints / f".tmp-{step_name(STEPS)}"
    (tmp / "dcp").mkdir(parents=True)
    files = {}
    per_rank = [name for r in range(WORLD) for name in (f"rank_{r:05d}.pt", f"dcp/__{r}_0.distcp")]
    for rel in [*per_rank, "dcp/.metadata", "train_state.json"]:
        os.link(blob, tmp / rel)
        files[rel] = entry
    commit(tmp, rundir.checkpoints / step_name(STEPS), {"step": STEPS, "loss": 3.0, "files": files})
    return Big(rundir, cfg, tuple(last))


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Big:
    return build(tmp_path_factory.mktemp("scale") / "run")


@pytest.fixture
def scratch(big, tmp_path) -> RunDir:
    """A copy of the big run's history and config, for the tests that write records."""
    rundir = RunDir(tmp_path / "run")
    rundir.create()
    rundir.history.write_bytes(big.rundir.history.read_bytes())
    rundir.config.write_bytes(big.rundir.config.read_bytes())
    return rundir


def silent_half(rundir: RunDir, nodes: tuple[str, ...]) -> None:
    """failure.json naming the 2,048 ranks of the second half (a switch lost: 256 nodes)."""
    rundir.write_failure(0, f"{len(SILENT)} ranks did not answer", FAILURE_CRASH,
                         [suspect(r, nodes, "did not answer the roll call") for r in SILENT])  # fmt: skip


# -- srun's output (hpc/driver.py) ----------------------------------------------------------------------------------
def srun_lines(per_task: bool) -> list[str]:
    """What srun prints when a node is lost and --kill-on-bad-exit ends the rest: the node failure, then a line
    per node and task range (or, per_task, per task: srun's lines for tasks that ended differently). The lost
    node's tasks never report."""
    out = [f"srun: error: Node failure on {NAMES[LOST]}"]
    for i, n in enumerate(NAMES):
        lo, hi = i * RPN, (i + 1) * RPN - 1
        if i == LOST:
            continue
        if per_task:
            out += [f"srun: error: {n}: task {t}: Exited with exit code 1" for t in range(lo, hi + 1)]
        else:
            out.append(f"srun: error: {n}: tasks {lo}-{hi}: Killed")
    return out


def read_lines(lines: list[str]) -> dict[str, set[int]]:
    """node -> the tasks srun's lines say ended there: run_srun_step's reading of a line (its pattern and parser),
    by node."""
    out: dict[str, set[int]] = {}
    for line in lines:
        m = drv.SRUN_TASK_ERROR.match(line.strip())
        if m:
            out.setdefault(m.group(1), set()).update(drv.task_numbers(m.group(2)))
    return out


@pytest.mark.parametrize("per_task", [False, True], ids=["ranges", "per-task"])
def test_srun_lines_give_every_task_of_every_node(per_task):
    lines = srun_lines(per_task)
    ended, seconds = timed(lambda: read_lines(lines), best_of=3)
    assert list(ended) == [n for i, n in enumerate(NAMES) if i != LOST]
    assert all(ended[n] == set(range(i * RPN, (i + 1) * RPN)) for i, n in enumerate(NAMES) if i != LOST)
    within(seconds, 0.1, f"reading {len(lines)} srun lines")
    comma = ",".join(str(t) for t in range(0, WORLD, 2))  # "0,2,4,...": one line naming every other task
    tasks, seconds = timed(lambda: drv.task_numbers(comma), best_of=3)
    assert tasks == set(range(0, WORLD, 2))
    within(seconds, 0.1, f"task_numbers of a list of {WORLD // 2} tasks")


def test_the_driver_ends_a_step_once_every_task_ended_or_was_named(tmp_path, capsys):
    """A lost node's tasks never report: srun waits on (here: sleeps). The ranks' diagnosis names that node's ranks,
    every other task has a line: the driver ends srun at its next poll (0.25 s), not STEP_GRACE_S (5 s) later, after
    copying srun's 4,089 lines through."""
    failure = tmp_path / "failure.json"
    lost = range(LOST * RPN, (LOST + 1) * RPN)
    failure.write_text(json.dumps({"rank": 0, "message": "m", "kind": FAILURE_CRASH,
                                   "suspects": [suspect(r, NAMES, "did not answer") for r in lost]}))  # fmt: skip
    err = tmp_path / "srun.err"
    err.write_text("\n".join(srun_lines(per_task=True)) + "\n")
    fake = ["sh", "-c", f"cat {err} >&2; exec sleep 30"]  # exec: the kill reaches the sleeper
    # the wall clock: what is timed is when the driver ends the step, not the CPU it spends
    end, seconds = timed(lambda: drv.run_srun_step(fake, dict(os.environ), failure, WORLD), time.perf_counter)
    out = capsys.readouterr()
    assert end.ended_srun and end.first_failed == 0 and end.failed_nodes == (NAMES[LOST],), end
    assert "every other task has ended" in out.out, out.out
    assert out.err.count("\n") == WORLD - RPN + 1  # every line copied through
    within(seconds, min(1.5, drv.STEP_GRACE_S), f"run_srun_step over {WORLD - RPN + 1} lines")


# -- bad-node records (hpc/policy/badnodes.py) ---------------------------------------------------------------------
def test_the_bad_node_records_of_a_long_history(big):
    rundir = big.rundir
    events, seconds = timed(lambda: bad_node_events(rundir), best_of=3)
    assert [(e["node"], e["launch"]) for e in events] == [(NAMES[LOST], f"L{LAUNCHES - 1}")]
    within(seconds, 0.1, "bad_node_events")
    names, seconds = timed(lambda: bad_nodes(rundir), best_of=3)
    assert names == [NAMES[LOST]]
    within(seconds, 0.1, "bad_nodes")
    assert [e["node"] for e in node_changes(rundir)] == [NAMES[LOST]]
    due, seconds = timed(lambda: due_back(rundir, 60.0, None, now=time.time() + 3600), best_of=3)
    assert list(due) == [NAMES[LOST]]
    within(seconds, 0.1, "due_back")


# -- the diagnosis that names ranks and their nodes (hpc/policy/decide.py) -----------------------------------------
def test_2048_silent_ranks_name_their_256_nodes_once_each(big, scratch):
    nodes = big.last_nodes
    silent_half(scratch, nodes)
    named, seconds = timed(lambda: drv.suspect_ranks(scratch.failure), best_of=3)
    assert named == set(SILENT)
    within(seconds, 0.1, f"suspect_ranks of {len(SILENT)} suspects")

    situation = Situation(slurm=True, nodes=nodes, launch_nodes=nodes, ranks_per_node=RPN)
    decision, seconds = timed(
        lambda: decide_after_launch(scratch, big.cfg.job, Ended("failed", 1), situation), best_of=3
    )
    half = nodes[NODES // 2 :]
    assert decision.new_bad == tuple((n, f"rank {i * RPN}: did not answer the roll call")
                                     for i, n in enumerate(nodes) if n in half)  # fmt: skip
    assert decision.action == "resubmit" and decision.exclude == (NAMES[LOST], *half), decision.action
    within(seconds, 0.15, f"decide_after_launch naming {len(half)} nodes")

    _, seconds = timed(lambda: record_decision(scratch, decision, failed_launch="L11", status=1))
    within(seconds, 0.15, f"record_decision of {len(half)} new bad nodes")
    record_decision(scratch, decision, failed_launch="L11", status=1)  # again (a launcher's retry): no new bad_node
    history = read_jsonl(scratch.history)
    assert Counter(e["node"] for e in history if e.get("event") == EVENT_BAD_NODE) == Counter([NAMES[LOST], *half])
    restart = [e for e in history if e.get("event") == EVENT_RESTART][-1]
    assert restart["launch"] == "L11" and restart["excluded"] == [NAMES[LOST], *half]
    names, seconds = timed(lambda: bad_nodes(scratch), best_of=3)
    assert names == [NAMES[LOST], *half]
    within(seconds, 0.1, "bad_nodes")

    # without a diagnosis, the rank srun saw end first names its node
    first = named_nodes({}, replace(situation, first_ended=WORLD - 1))
    assert first == [(nodes[-1], f"rank {WORLD - 1}'s process ended first (the others were ended after it)")]


# -- the launchers' usable nodes (hpc/policy/badnodes.py usable_nodes, hpc/driver.py and hpc/submit.py) -----------
def test_the_usable_nodes_of_an_allocation_leave_the_bad_ones_out(big, scratch):
    """A job on L10's 512 nodes, 256 of them named bad since (and the run has one more): the 256 left, in order."""
    silent_half(scratch, big.last_nodes)
    situation = Situation(slurm=True, nodes=big.last_nodes, launch_nodes=big.last_nodes, ranks_per_node=RPN)
    record_decision(scratch, decide_after_launch(scratch, big.cfg.job, Ended("failed", 1), situation),
                    failed_launch="L11", status=1)  # fmt: skip
    assert len(bad_nodes(scratch)) == NODES // 2 + 1
    usable, seconds = timed(lambda: usable_nodes(scratch, big.last_nodes), best_of=3)
    assert usable == tuple(big.last_nodes[: NODES // 2])
    within(seconds, 0.25, "the usable nodes of a 512-node allocation with 257 bad nodes")


# -- hpc status, the report's analysis ---------------------------------------------------------------------------
def test_status_of_a_4096_rank_run(big):
    rundir = big.rundir
    ckpt, seconds = timed(lambda: latest_committed(rundir.checkpoints), best_of=3)
    assert ckpt["step"] == STEPS and len(ckpt["files"]) == 2 * WORLD + 2
    within(seconds, 0.5, f"latest_committed of a generation of {2 * WORLD + 2} files")
    ended, seconds = timed(lambda: how_it_ended(rundir, f"L{LAUNCHES}", 0), best_of=3)
    assert ended == Ended("done", 0, recorded=True)
    within(seconds, 0.1, "how_it_ended of the done launch")
    ended, seconds = timed(
        lambda: how_it_ended(rundir, f"L{LAUNCHES - 2}", 75), best_of=3
    )  # a stop: the checkpoint's files
    assert ended == Ended("stopped", 75, signal.SIGUSR2, recorded=True)
    within(seconds, 0.5, "how_it_ended of a stopped launch")
    info, seconds = timed(lambda: status(rundir), best_of=3)
    assert (info["state"], info["step"], info["restarts"], info["checkpoint"]) == (
        "completed",
        STEPS,
        LAUNCHES - 1,
        {"step": STEPS, "loss": 3.0},
    )
    assert [b["node"] for b in info["bad_nodes"]] == [NAMES[LOST]] and info["failure"] is None
    within(seconds, 0.75, "status in process")


@pytest.mark.parametrize("json_out", [False, True], ids=["text", "json"])
def test_hpc_status_command_on_a_4096_rank_run(big, json_out):
    args = ["-m", "hpc", "status", str(big.rundir.root), *(["--json"] if json_out else [])]
    proc, seconds = timed(lambda: run_cli(args, timeout=60))
    assert proc.returncode == 0, proc.stderr
    if json_out:
        info = json.loads(proc.stdout)
        assert info["state"] == "completed" and [b["node"] for b in info["bad_nodes"]] == [NAMES[LOST]]
    else:
        assert (
            f"completed, step {STEPS}/{STEPS}" in proc.stdout
            and f"bad node (left out of later launches): {NAMES[LOST]}" in proc.stdout
        ), proc.stdout
    within(seconds, 3.0, f"python -m hpc status{' --json' if json_out else ''}")


def test_the_reports_analysis_of_a_4096_rank_run(big):
    """hpc/report.py without the figures (bench/scale.py times those)."""
    rundir = big.rundir

    def text():
        log = analyze(rundir)
        f = facts(log, {"train": {"steps": STEPS}})
        return log, f, markdown(log, f, images=[]), summary_lines(log, f)

    (log, f, md, lines), seconds = timed(text, best_of=3)
    assert len(log.launches) == LAUNCHES and log.restarts == LAUNCHES - 1
    assert len(log.kept) == STEPS // 10 and len(log.discarded) == ((LAUNCHES - 1) * PER_LAUNCH - CHECKPOINT) // 10
    assert log.stragglers.checks == (len(log.kept) + len(log.discarded)) // 5 and f["world_size"] == WORLD
    assert "# Run report" in md and lines
    within(seconds, 0.25, "the report's analysis and text")


def test_the_reports_per_rank_chart_of_a_4096_rank_run(big, tmp_path):
    """hpc/plots.py's straggler figure: one line per rank in a single collection above MANY_RANKS (a bar per rank
    took 1.5 CPU-s to build and draw at 4,096), the straggler's rank red and marked."""
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure

    from hpc.plots import MANY_RANKS, _ranks

    log = analyze(big.rundir)

    def draw():
        fig = _ranks(Figure, log, "run")
        fig.savefig(tmp_path / "ranks.png")
        return fig

    fig, seconds = timed(draw, best_of=3)  # the first draw also loads matplotlib's fonts and backend
    (lines,) = [c for c in fig.axes[1].collections if isinstance(c, LineCollection)]
    assert WORLD > MANY_RANKS and len(lines.get_segments()) == WORLD and not fig.axes[1].patches
    red = [i for i, c in enumerate(lines.get_colors()) if c[0] > 0.8 and c[2] < 0.3]
    assert red == [137], red  # the straggler metrics_record flags
    assert (tmp_path / "ranks.png").stat().st_size > 0
    # the one collection above pins the fix; the bound only catches a gross regression on a slow machine (0.75 CPU-s
    # here, 1.09 once on a loaded VM's first draw)
    within(seconds, 3.0, "the per-rank chart")
