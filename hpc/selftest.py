"""``python -m hpc selftest CONFIG [--set K=V] [--timeout S] [--run-dir DIR] [--keep] [--json]``, on a login node:
does the configured stop signal reach every rank, and does ``job.signal_lead_s`` cover a stop? (torch-free)

It submits through ``python -m hpc.submit``'s path a short job of the config's shape into a throw-away run
directory, changing only SELFTEST_SETTINGS (so many steps that only the signal ends it, no periodic checkpoint or
eval, no requeue or restart). Once every rank trains it sends the signal as Slurm does before the time limit
(``scancel --signal=SIG JOBID``: every process of the job's steps), waits up to ``job.signal_lead_s`` for the
ranks' stop, ends the job, and reads what the ranks recorded (rundir/stopsignal.py): which ranks received the
signal themselves, the process chain of each that did not (naming the wrapper that swallowed it), the stop's and
the save's seconds, and whether the lead covers them with the margin ``SAFETY_FACTOR``. It also checks the
script's ``#SBATCH --signal`` line and flags SIGUSR1 with CUDA/NCCL.

Output: one PASS, WARN or FAIL line per check (``--json``: one object). Exit status: 0 all good; 1 a rank missed
the signal, the script does not send it to the steps, or the job never got that far; 2 bad input (the config, or
no Slurm here); 4 (EXIT_LEAD_SHORT) the lead is too short. Checkpoints are removed afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpc import slurmctl
from hpc.options import add_set_option, set_arguments
from hpc.submit import default_run_dir
from hpc.submit import main as submit_main
from runconfig import ConfigError, RunConfig, load_config
from rundir import RunDir
from rundir.contract import (
    EVENT_STOPPED,
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_LEAD_SHORT,
    EXIT_USER_ERROR,
    rank_ranges,
)
from rundir.paths import read_jsonl
from rundir.stopsignal import (
    SAFETY_FACTOR,
    LeadBudget,
    describe_process,
    wrappers,
)

#: What the self-test's job changes in the config (after the user's --set): only the signal ends it.
SELFTEST_SETTINGS = (
    "train.steps=1000000",
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.every_steps=0",
    "checkpoint.every_minutes=0",
    "job.max_requeues=0",
    "job.max_failures=0",
)
STARTED_AT_STEP = 2  # metrics.jsonl has this step: every rank took part in a step's collective, handlers in place
POLL_S = 0.5
END_WAIT_S = 90.0  # for the job to end after the stop, or after scancel
SBATCH_SIGNAL_RE = re.compile(r"^#SBATCH\s+--signal=(\S+)", re.MULTILINE)


@dataclass
class Observed:
    """What the self-test's job showed: the facts its verdict is made from (JSON-able)."""

    signal: str  # job.signal, e.g. SIGUSR2
    lead_s: float  # job.signal_lead_s
    world_size: int
    run_dir: str = ""
    job_id: str = ""
    sbatch_signal: str | None = None  # the submitted script's --signal value, e.g. USR2@120; None: none there
    started: bool = False  # every rank reached training before the signal was sent
    stopped: dict | None = None  # the stopped event after the signal, if any
    stopped_within_lead: bool = False
    records: dict[int, dict] = field(default_factory=dict)  # rank -> its record in logs/signal_node_N.json
    job_state: str = ""
    nccl: bool = False  # the config would run CUDA/NCCL
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Check:
    level: str  # PASS, WARN or FAIL
    what: str  # sbatch, start, signal, stop, lead, nccl
    message: str


def uses_cuda(cfg: RunConfig) -> bool:
    """Whether the ranks would run on CUDA with NCCL (torch-free: from the config alone)."""
    return (
        cfg.comm.backend == "nccl"
        or cfg.train.device == "cuda"
        or (cfg.train.device == "auto" and cfg.job.gpus_per_node > 0)
    )


def missing_ranks(obs: Observed) -> list[int]:
    """The ranks that did not record receiving job.signal themselves."""
    got = set((obs.stopped or {}).get("received", {}).get(obs.signal, []))
    return [r for r in range(obs.world_size) if r not in got]


def why_missed(obs: Observed, rank: int) -> str:
    """What the rank's record says about its signal path."""
    record = obs.records.get(rank)
    if record is None:
        return "no signal record (the rank did not start, or could not write logs/)"
    chain = record.get("chain") or []
    between = wrappers(chain)
    parts = []
    if obs.signal in record.get("blocked", []):
        parts.append(f"the rank's process had {obs.signal} blocked since it started (inherited from its parent)")
    if between:
        listed = "; ".join(describe_process(p, obs.signal, pid=False) for p in between)  # alike on every rank
        parts.append(f"between slurmstepd and the rank: {listed}")
    elif any(p.get("name") == "slurmstepd" for p in chain):
        parts.append("no process between slurmstepd and the rank")
    else:
        parent = describe_process(chain[1], obs.signal, pid=False) if len(chain) > 1 else "unknown"
        parts.append(f"slurmstepd is not among the rank's ancestors (it runs outside the step?); its parent: {parent}")
    return "; ".join(parts)


def assess(obs: Observed) -> list[Check]:
    """The verdict, check by check, from what the job showed (pure)."""
    checks = [_sbatch_check(obs)]
    if obs.nccl and obs.signal == "SIGUSR1":
        checks.append(
            Check(
                "WARN",
                "nccl",
                "job.signal is SIGUSR1 and the ranks would use CUDA/NCCL: on some systems NCCL or the CUDA stack "
                "takes SIGUSR1 for itself (which is why checkpoint.stop_signals leaves it out by default); prefer "
                "SIGUSR2",
            )
        )
    if not obs.started:
        checks.append(
            Check("FAIL", "start", "the job did not reach training, so no signal was sent: " + "; ".join(obs.notes))
        )
        return checks
    checks += [Check("WARN", "job", note) for note in obs.notes]
    missing = missing_ranks(obs)
    checks += _signal_checks(obs, missing)
    if not missing:
        checks += _stop_checks(obs)
    return checks


def _sbatch_check(obs: Observed) -> Check:
    """Whether the submitted script asks Slurm to send job.signal to the steps' processes."""
    if obs.sbatch_signal is None:
        return Check("FAIL", "sbatch", "the submitted script has no #SBATCH --signal: Slurm would send nothing")
    if obs.sbatch_signal.upper().startswith("B:"):
        return Check(
            "FAIL",
            "sbatch",
            f"#SBATCH --signal={obs.sbatch_signal} signals the batch shell only (B:): the ranks would never get "
            "it (job.sbatch_extra overrides the signal?)",
        )
    name, _, when = obs.sbatch_signal.rpartition(":")[2].partition("@")
    level = "PASS" if name.upper().removeprefix("SIG") == obs.signal.removeprefix("SIG") else "FAIL"
    return Check(
        level,
        "sbatch",
        f"#SBATCH --signal={obs.sbatch_signal}: {name} to every process of the job's steps {when or '?'} s "
        "before the time limit" + ("" if level == "PASS" else f", but job.signal is {obs.signal}"),
    )


def _signal_checks(obs: Observed, missing: list[int]) -> list[Check]:
    """Every rank received the signal itself; else why each rank that did not missed it."""
    if not missing:
        return [Check("PASS", "signal", f"all {obs.world_size} ranks received {obs.signal} themselves")]
    if obs.stopped is None:
        head = f"no rank stopped within job.signal_lead_s={obs.lead_s:g} s of {obs.signal}"
    elif obs.stopped.get("received", {}).get(obs.signal):
        head = f"{len(missing)} of {obs.world_size} ranks did not receive {obs.signal} (the others stopped them)"
    else:
        first = obs.stopped.get("received") or {}
        head = f"no rank received {obs.signal}" + (
            f"; they stopped on {', '.join(first)} when the self-test ended the job" if first else ""
        )
    checks = [Check("FAIL", "signal", head)]
    groups: dict[str, list[int]] = {}
    for rank in missing:
        groups.setdefault(why_missed(obs, rank), []).append(rank)
    for why, ranks in groups.items():
        checks.append(Check("FAIL", "signal", f"rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}: {why}"))
    return checks


def _stop_checks(obs: Observed) -> list[Check]:
    """What the stop cost, against job.signal_lead_s."""
    stop = obs.stopped or {}
    needed = stop.get("signal_to_commit_s")
    if not isinstance(needed, (int, float)):
        return [Check("FAIL", "stop", "the stopped event has no timings (a trainer older than this self-test?)")]
    figures = (
        f"{stop.get('stop_s', float('nan')):.2f} s from the signal to every rank agreeing at a step boundary, "
        f"{stop.get('save_s', float('nan')):.2f} s to save and commit the checkpoint, {needed:.2f} s in all"
    )
    budget = LeadBudget(lead_s=obs.lead_s, needed_s=float(needed), measured=True)
    return [Check("PASS", "stop", figures), Check("PASS" if budget.ok else "FAIL", "lead", budget.describe())]


def exit_status(checks: list[Check]) -> int:
    failed = {c.what for c in checks if c.level == "FAIL"}
    if failed - {"lead"}:
        return EXIT_FAILED
    return EXIT_LEAD_SHORT if failed else EXIT_DONE


def summary(obs: Observed, checks: list[Check]) -> dict:
    """The --json output."""
    stop = obs.stopped or {}
    missing = missing_ranks(obs) if obs.started else list(range(obs.world_size))
    needed = stop.get("signal_to_commit_s")
    return {
        "status": exit_status(checks),
        "checks": [asdict(c) for c in checks],
        "run_dir": obs.run_dir,
        "job_id": obs.job_id,
        "signal": obs.signal,
        "lead_s": obs.lead_s,
        "safety_factor": SAFETY_FACTOR,
        "world_size": obs.world_size,
        "received": sorted(set(range(obs.world_size)) - set(missing)),
        "missing": missing,
        "stop_s": stop.get("stop_s"),
        "save_s": stop.get("save_s"),
        "signal_to_commit_s": needed,
        "required_lead_s": LeadBudget(obs.lead_s, float(needed), True).required_s
        if isinstance(needed, (int, float))
        else None,
        "wrappers": {
            str(r): [describe_process(p, obs.signal) for p in wrappers(rec.get("chain") or [])]
            for r, rec in sorted(obs.records.items())
        },
        "sbatch_signal": obs.sbatch_signal,
        "job_state": obs.job_state,
    }


def render(obs: Observed, checks: list[Check]) -> str:
    """The human-readable report: a heading, then one line per check."""
    head = f"selftest of {obs.signal} (lead {obs.lead_s:g} s) on {obs.world_size} ranks"
    if obs.job_id:
        head += f", Slurm job {obs.job_id}"
    lines = [head + (f"; run directory {obs.run_dir}" if obs.run_dir else "")]
    lines += [f"{c.level} {c.what}: {c.message}" for c in checks]
    status = exit_status(checks)
    verdict = {EXIT_DONE: "all good", EXIT_LEAD_SHORT: "the lead time is too short"}.get(status, "failed")
    lines.append(f"selftest: {verdict} (exit status {status})")
    return "\n".join(lines)


# -- running it on the cluster -------------------------------------------------------------------------------------
def _metrics_step(rundir: RunDir) -> int:
    records = read_jsonl(rundir.metrics)
    return max((r.get("step", 0) for r in records if isinstance(r.get("step"), int)), default=0)


def _stopped(rundir: RunDir) -> dict | None:
    """The run's first stopped event. The run directory is the self-test's own, and the run is one that only a
    signal ends (not compared with the time the signal was sent: the login node's clock is not the nodes')."""
    events = [e for e in read_jsonl(rundir.history) if e.get("event") == EVENT_STOPPED]
    return events[0] if events else None


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(POLL_S)
    return predicate()


def _cancel(job_id: str, signal: str | None = None) -> str | None:
    """scancel (or send ``signal``); why it failed, if it did."""
    try:
        slurmctl.cancel([job_id], signal=signal)
    except slurmctl.SlurmError as exc:
        return str(exc)
    return None


def run_job(cfg: RunConfig, config: str, overrides: list[str], run_dir: Path, timeout: float) -> Observed:
    """Submit the self-test's job, signal it, and collect what it showed."""
    obs = Observed(
        signal=cfg.job.signal, lead_s=cfg.job.signal_lead_s, world_size=cfg.job.world_size, run_dir=str(run_dir)
    )
    obs.nccl = uses_cuda(cfg)
    minutes = math.ceil((timeout + cfg.job.signal_lead_s + END_WAIT_S) / 60) + 1
    name = f"selftest-{cfg.job.name}"[:64]
    sets = [*overrides, *SELFTEST_SETTINGS, f"job.time={minutes}", f"job.name={name}"]
    with contextlib.redirect_stdout(sys.stderr):  # submit's chatter; stdout is the report's
        status = submit_main([config, "--run-dir", str(run_dir), *set_arguments(sets)])
    if status != 0:
        raise SelftestError(status, "submitting the self-test's job failed (see above)")
    rundir = RunDir(run_dir)
    jobs = read_jsonl(rundir.jobs)
    obs.job_id = str(jobs[-1]["job_id"])
    script = rundir.job_script(obs.job_id)
    found = SBATCH_SIGNAL_RE.search(script.read_text()) if script.is_file() else None
    obs.sbatch_signal = found.group(1) if found else None
    print(f"submitted Slurm job {obs.job_id}; waiting for every rank to train", file=sys.stderr, flush=True)
    try:
        ended = lambda: slurmctl.job_state(obs.job_id).finished  # noqa: E731
        obs.started = _wait(lambda: _metrics_step(rundir) >= STARTED_AT_STEP or ended(), timeout)
        obs.started = obs.started and _metrics_step(rundir) >= STARTED_AT_STEP
        if not obs.started:
            state = slurmctl.job_state(obs.job_id)
            obs.notes.append(
                f"job {obs.job_id} is {state.state}"
                + (f" ({state.reason})" if state.reason and state.reason != "None" else "")
                + ("" if state.finished else f" after --timeout {timeout:g} s")
                + f"; see {rundir.logs} and {rundir.slurm_output}"
            )
            return obs
        print(f"sending {cfg.job.signal} to job {obs.job_id} (scancel --signal)", file=sys.stderr, flush=True)
        error = _cancel(obs.job_id, signal=cfg.job.signal.removeprefix("SIG"))
        if error:
            obs.notes.append(f"scancel --signal failed: {error}")
        # As at a time limit: the ranks have job.signal_lead_s to commit their checkpoint, then the job ends.
        stopped = _wait(lambda: _stopped(rundir) is not None or ended(), cfg.job.signal_lead_s)
        obs.stopped_within_lead = stopped and _stopped(rundir) is not None
        if not obs.stopped_within_lead and not ended():
            print(f"no stop within {cfg.job.signal_lead_s} s; ending the job (scancel)", file=sys.stderr, flush=True)
            _cancel(obs.job_id)
        _wait(ended, END_WAIT_S)
        obs.stopped = _stopped(rundir)
        if obs.stopped is not None and not obs.stopped_within_lead:  # a stop on the SIGTERM of scancel
            obs.notes.append("the ranks stopped only after the self-test ended the job")
    finally:
        if not slurmctl.job_state(obs.job_id).finished:
            _cancel(obs.job_id)
        obs.job_state = slurmctl.job_state(obs.job_id).state
        obs.records = rundir.signal_records()
    return obs


class SelftestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hpc selftest",
        description="Submit a short job of the config's shape, send it the configured stop signal as Slurm does "
        "before the time limit, and report which ranks received it, how long the stop and its checkpoint took, and "
        "whether job.signal_lead_s covers that with margin. Exit status: 0 all good; 1 a rank did not receive the "
        "signal (or the job did not get that far); 2 bad input; 4 every rank received it but the lead is too short.",
    )
    p.add_argument("config", help="config file or built-in example name")
    add_set_option(p)
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the job to start training (default 600)"
    )
    p.add_argument("--run-dir", type=Path, help="the self-test's run directory (default runs/selftest-NAME-TIME)")
    p.add_argument("--keep", action="store_true", help="keep the self-test's checkpoints")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if not slurmctl.available():
            raise SelftestError(EXIT_USER_ERROR, "the self-test needs Slurm: no sbatch on PATH, or no cluster config")
        if args.timeout <= 0:
            raise SelftestError(EXIT_USER_ERROR, f"--timeout must be > 0, got {args.timeout:g}")
        run_dir = (args.run_dir or default_run_dir(f"selftest-{cfg.job.name}")).absolute()
        obs = run_job(cfg, args.config, args.overrides, run_dir, args.timeout)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except SelftestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130
    if not args.keep:
        shutil.rmtree(RunDir(run_dir).checkpoints, ignore_errors=True)
    checks = assess(obs)
    print(json.dumps(summary(obs, checks), indent=2) if args.json else render(obs, checks))
    return exit_status(checks)
