"""The lifecycle verbs on a run directory, for the login node (torch-free): cancel, pause, release, resume, logs,
unexclude and sbatch-args (``hpc/cli.py`` dispatches ``python -m hpc VERB``; status is hpc/status.py, sweep
hpc/sweep_submit.py).

All of them work without Slurm accounting (slurmdbd): job states come from the controller while it remembers the
jobs (MinJobAge after they end), then from sacct when accounting is there; else they are UNKNOWN, with the reason.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hpc import slurmctl
from hpc.jobs import exclude_pending, states, unfinished
from hpc.options import set_arguments
from hpc.policy.badnodes import bad_nodes, take_back
from hpc.slurm import sbatch_options
from hpc.status import VerbError, status
from hpc.submit import main as submit_main
from runconfig import load_config
from rundir import RunDir


def sbatch_args(config: str, overrides: list[str]) -> list[str]:
    """sbatch options from a config (a run directory's own config, with its bad nodes excluded)."""
    rundir = RunDir(Path(config).absolute())
    if rundir.config.is_file():
        cfg, exclude = load_config(str(rundir.config), overrides), tuple(bad_nodes(rundir))
    else:
        cfg, exclude = load_config(config, overrides), ()
    # Printed for `sbatch $(python -m hpc sbatch-args CONFIG)`: a command substitution splits words but removes no
    # quotes, so none are added; every value is checked whole to hold no blank (runconfig/schema/slurm_syntax.py).
    options = sbatch_options(cfg, exclude=exclude)
    spaced = [option for option in options if any(c.isspace() for c in option)]
    if spaced:
        raise VerbError(f"sbatch-args: {spaced[0]!r} holds a blank, which $(...) would split: set it in the job "
                        "script's #SBATCH lines instead.")  # fmt: skip
    return options


def cancel(rundir: RunDir) -> None:
    ids = unfinished(rundir)
    if not ids:
        raise VerbError(f"run {rundir.root} has no unfinished Slurm job to cancel.")
    slurmctl.cancel(ids)
    print(f"cancelled job{'s' if len(ids) > 1 else ''} {', '.join(ids)}")


def pause(rundir: RunDir) -> None:
    jobs = [j for j in states(rundir) if not j.finished]
    if not jobs:
        raise VerbError(f"run {rundir.root} has no unfinished Slurm job to pause.")
    ids = [j.job_id for j in jobs]
    cfg = load_config(str(rundir.config))
    rundir.pause_marker.write_text(f"{time.time()}\n")
    signal = cfg.job.signal.removeprefix("SIG")
    for job in jobs:
        if job.state == "RUNNING":  # the ranks stop at a step boundary; the driver then requeues it held
            slurmctl.cancel([job.job_id], signal=signal)
        else:
            slurmctl.hold(job.job_id)
    print(
        f"pausing job{'s' if len(ids) > 1 else ''} {', '.join(ids)}: the run stops at the next step boundary "
        f"with a checkpoint and is held; continue with: python -m hpc release {rundir.root}"
    )


def release(rundir: RunDir) -> None:
    rundir.pause_marker.unlink(missing_ok=True)
    ids = [j.job_id for j in states(rundir) if j.held]
    for job in ids:
        slurmctl.release(job)
    print(f"released job{'s' if len(ids) > 1 else ''} {', '.join(ids)}" if ids else "no held job; pause marker removed")


def logs(rundir: RunDir, *, rank: int, all_ranks: bool, follow: bool) -> None:
    paths = sorted(rundir.logs.glob("rank_*.log")) if all_ranks else [rundir.rank_log(rank)]
    missing = [p for p in paths if not p.exists()]
    if not paths or missing:
        raise VerbError(f"no log {missing[0] if missing else rundir.logs / 'rank_*.log'} yet.")
    offsets = {}
    for p in paths:
        data = p.read_text(errors="replace")
        sys.stdout.write(data)
        offsets[p] = len(data.encode())
    sys.stdout.flush()
    while follow:
        time.sleep(0.5)
        for p in paths:
            with open(p, "rb") as f:
                f.seek(offsets[p])
                chunk = f.read()
            offsets[p] += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()
        if status(rundir)["state"] in ("completed", "pruned"):
            break


def unexclude(rundir: RunDir, nodes: list[str]) -> None:
    """Take bad nodes of the run back (a ``node_back`` event each): its next launch, an in-job restart or a new job,
    may use them, and the run's pending jobs no longer exclude them. Refused for a node that is not bad, and for one
    Slurm still holds down or drained (its verdict stands: bring it back in Slurm first)."""
    bad = bad_nodes(rundir)
    unknown = [n for n in nodes if n not in bad]
    if unknown:
        listed = ", ".join(bad) if bad else "none"
        raise VerbError(f"{', '.join(unknown)}: not a bad node of run {rundir.root} (its bad nodes: {listed})")
    held = slurmctl.held_by_slurm(nodes)
    if held:
        verdicts = "; ".join(f"{n} is {v}" for n, v in held.items())
        raise VerbError(
            f"not taken back: Slurm still holds {verdicts}. Return it to service first (scontrol update "
            f"NodeName={','.join(held)} State=RESUME), then run this again."
        )
    for node in nodes:
        take_back(rundir, node, how="by hand (python -m hpc unexclude)")
    left = tuple(n for n in bad if n not in nodes)
    pending = exclude_pending(rundir, left, skip=set())[0]  # one query: none without pending jobs
    where = f"; pending job(s) {', '.join(pending)} now exclude {', '.join(left) or 'nothing'}" if pending else ""
    print(f"taken back: {', '.join(nodes)}; the run's next launch may use them{where}")


def resume(rundir: RunDir, overrides: list[str], *, refresh_code: bool) -> int:
    """Resubmit a finished, failed or cancelled run from its newest checkpoint (``python -m hpc.submit --resume``)."""
    if unfinished(rundir):
        raise VerbError(f"run {rundir.root} still has an unfinished job; `release` or `cancel` it first.")
    rundir.pause_marker.unlink(missing_ok=True)
    refresh = ["--refresh-code"] if refresh_code else []
    return submit_main(["--resume", str(rundir.root), *set_arguments(overrides), *refresh])
