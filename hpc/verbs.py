"""The lifecycle verbs on a run directory, for the login node (torch-free): status, cancel, pause, release,
resume, logs, sweep and sbatch-args (``hpc/cli.py`` dispatches ``python -m hpc VERB``).

All of them work without Slurm accounting (slurmdbd); job states come from scontrol while the controller
remembers the jobs (MinJobAge after they end), then from sacct when accounting is there; else they are UNKNOWN,
with the reason.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from hpc.follow import resume_notes
from hpc.jobs import job_ids, query, run
from hpc.options import set_arguments
from hpc.policy.badnodes import bad_node_events
from runconfig import load_config
from rundir import RunDir
from rundir.checkpoints import latest_committed
from rundir.contract import EVENT_CODE, EVENT_PRUNED, EVENT_RESUME
from rundir.paths import read_jsonl
from rundir.stopsignal import newest_budget


class VerbError(Exception):
    pass


def sbatch_args(config: str, overrides: list[str]) -> list[str]:
    """sbatch options from a config (a run directory's own config, with its bad nodes excluded)."""
    import shlex

    from hpc.policy.badnodes import bad_nodes
    from hpc.slurm import sbatch_options

    rundir = RunDir(Path(config).absolute())
    if rundir.config.is_file():
        cfg, exclude = load_config(str(rundir.config), overrides), tuple(bad_nodes(rundir))
    else:
        cfg, exclude = load_config(config, overrides), ()
    return [shlex.quote(option) for option in sbatch_options(cfg, exclude=exclude)]


def open_run(path: str) -> RunDir:
    rundir = RunDir(Path(path).absolute())
    if not rundir.config.is_file():
        raise VerbError(f"{path} is not a run directory (it has no config.yaml).")
    return rundir


def _last_metrics(rundir: RunDir) -> dict | None:
    records = read_jsonl(rundir.metrics)
    return records[-1] if records else None


def status(rundir: RunDir) -> dict:
    cfg = load_config(str(rundir.config))
    ids = job_ids(rundir)
    jobs = [query(j) for j in ids]
    ckpt = latest_committed(rundir.checkpoints)
    last = _last_metrics(rundir)
    history = read_jsonl(rundir.history)
    done = rundir.summary.is_file()
    active = [j for j in jobs if not j.finished]
    pruned = any(e.get("event") == EVENT_PRUNED for e in history)
    state = "pruned" if pruned and done else "completed" if done else ("paused" if rundir.pause_marker.exists() else "")
    failure = _failure(rundir, history)
    budget = newest_budget(rundir, cfg.job.signal_lead_s)  # a stop's cost, measured or estimated, vs the lead
    if not state:
        if active:
            state = active[0].state.lower()
        elif failure:
            state = "failed"
        else:
            launched = any(e.get("event") != EVENT_CODE for e in history)  # the snapshot's event is no launch
            state = "stopped" if launched else "not started"
    return {
        "run_dir": str(rundir.root),
        "state": state,
        "jobs": [
            {"job_id": j.job_id, "state": j.state, "reason": j.reason, "restarts": j.restarts, "source": j.source}
            for j in jobs
        ],
        "restarts": sum(1 for e in history if e["event"] == EVENT_RESUME),
        "step": (last or {}).get("step", 0),
        "steps": cfg.train.steps,
        "loss": (last or {}).get("loss"),
        "checkpoint": {"step": ckpt["step"], "loss": ckpt.get("loss")} if ckpt else None,
        "failure": failure,
        "bad_nodes": [{k: e.get(k) for k in ("node", "evidence", "launch")} for e in bad_node_events(rundir)],
        "stop_lead": {**budget.fields(), "message": budget.describe()} if budget else None,
        "resume_warnings": resume_notes(next((e for e in reversed(history) if e["event"] == EVENT_RESUME), {})),
    }


def _failure(rundir: RunDir, history: list[dict]) -> str | None:
    """The message of failure.json when it was written after the latest launch started (else it is stale)."""
    message = rundir.failure_message()
    if message is None:
        return None
    starts = [e.get("time", 0) for e in history if e.get("event") in ("start", "resume")]
    try:
        return message if not starts or rundir.failure.stat().st_mtime >= max(starts) else None
    except OSError:
        return None


def print_status(info: dict) -> None:
    pct = 100 * info["step"] / max(1, info["steps"])
    print(f"run {info['run_dir']}: {info['state']}, step {info['step']}/{info['steps']} ({pct:.0f}%)", end="")
    print(f", loss {info['loss']:.4f}" if info["loss"] is not None else "")
    ckpt = info["checkpoint"]
    loss = f", loss {ckpt['loss']:.4f}" if ckpt and ckpt["loss"] is not None else ""
    committed = f"step {ckpt['step']}{loss}" if ckpt else "none"
    print(f"  last committed checkpoint: {committed}")
    print(f"  restarts: {info['restarts']}")
    if info.get("failure"):
        print(f"  failure: {info['failure']}")
    for note in info.get("resume_warnings") or []:
        print(f"  {note}")
    for bad in info.get("bad_nodes") or []:
        print(f"  bad node (left out of later launches): {bad['node']}: {bad['evidence']}")
    lead = info.get("stop_lead")
    if lead:
        how = "measured" if lead["measured"] else "estimated"
        verdict = "ok" if lead["ok"] else "too short"
        print(f"  stop signal lead: {lead['lead_s']:g} s for a stop of {lead['needed_s']:.1f} s ({how}): {verdict}")
        if not lead["ok"]:
            print(f"  warning: {lead['message']}")
    for j in info["jobs"]:
        reason = f" ({j['reason']})" if j["reason"] and j["reason"] != "None" else ""
        if j["source"] == "scontrol":
            print(f"  job {j['job_id']}: {j['state']}{reason}, {j['restarts']} requeues")
        elif j["source"] == "sacct":
            note = "from sacct: the controller no longer knows the job"
            print(f"  job {j['job_id']}: {j['state']}{reason}, {j['restarts']} requeues ({note})")
        else:
            print(f"  job {j['job_id']}: {j['state']}{reason}")


def unfinished(rundir: RunDir) -> list[str]:
    return [j for j in job_ids(rundir) if not query(j).finished]


def cancel(rundir: RunDir) -> None:
    ids = unfinished(rundir)
    if not ids:
        raise VerbError(f"run {rundir.root} has no unfinished Slurm job to cancel.")
    run(["scancel", *ids])
    print(f"cancelled job{'s' if len(ids) > 1 else ''} {', '.join(ids)}")


def pause(rundir: RunDir) -> None:
    ids = unfinished(rundir)
    if not ids:
        raise VerbError(f"run {rundir.root} has no unfinished Slurm job to pause.")
    cfg = load_config(str(rundir.config))
    rundir.pause_marker.write_text(f"{time.time()}\n")
    signal = cfg.job.signal.removeprefix("SIG")
    for job in ids:
        state = query(job)
        if state.state == "RUNNING":  # the ranks stop at a step boundary; the driver then requeues it held
            run(["scancel", f"--signal={signal}", job])
        else:
            run(["scontrol", "hold", job])
    print(
        f"pausing job{'s' if len(ids) > 1 else ''} {', '.join(ids)}: the run stops at the next step boundary "
        f"with a checkpoint and is held; continue with: python -m hpc release {rundir.root}"
    )


def release(rundir: RunDir) -> None:
    rundir.pause_marker.unlink(missing_ok=True)
    ids = [j for j in unfinished(rundir) if query(j).held]
    for job in ids:
        run(["scontrol", "release", job])
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


def sweep(args: argparse.Namespace) -> int:
    from hpc import sweep as sw
    from hpc.driver import Driver
    from hpc.slurm import make_executor
    from hpc.submit import config_search, slurm_available, snapshot_new_run
    from hpc.submit import main as submit_main
    from rundir.snapshot import locate

    if args.parallel is not None and args.parallel < 1:
        raise VerbError(f"--parallel {args.parallel}: at least 1 element at once.")
    name = load_config(args.config, args.overrides).job.name
    sweep_dir = (args.run_dir or Path("runs") / f"sweep-{name}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    spec, elements = sw.expand(args.config, args.grid, args.overrides, sweep_dir)
    search = config_search(args.config)
    for _, cfg in elements:  # every element's recipe module is found before anything is made
        locate(cfg.recipe, search)
    dirs = sw.create(sweep_dir, elements)
    sw.write_spec(sweep_dir, spec)
    for d, (_, cfg) in zip(dirs, elements, strict=True):  # each element runs the code of submit time
        snapshot_new_run(d, cfg.recipe, search)
    from hpc.sweeptrack import open_parent

    open_parent(sweep_dir, elements[0][1], spec.summary(), list(spec.points[0]))
    if args.local or not slurm_available():
        sw.record(sweep_dir, elements, dirs, [""] * len(dirs))
        statuses = []
        for d in dirs:
            statuses.append(submit_main(["--resume", str(d.root), "--local"]))
            table = sw.element_ended(d, "failed" if statuses[-1] not in (0, 75) else None)
            if table:
                print(table)
        return max(statuses)
    os.umask(0o077)
    executor = make_executor(elements[0][1], RunDir(sweep_dir))
    if args.parallel:
        executor.update_parameters(array_parallelism=args.parallel)
    sw.record(sweep_dir, elements, dirs, [""] * len(dirs))  # before the array: an element that starts at once reads it
    jobs = executor.submit_array([Driver(str(d.root)) for d in dirs])
    ids = [str(j.job_id) for j in jobs]
    sw.record(sweep_dir, elements, dirs, ids)
    print(
        f"submitted a {len(ids)}-element sweep as job array {ids[0].split('_')[0]}; run directories under "
        f"{sweep_dir} (see sweep.json)"
    )
    return 0


def unexclude(rundir: RunDir, nodes: list[str]) -> None:
    """Take bad nodes of the run back (a ``node_back`` event each): its next launch, an in-job restart or a new job,
    may use them, and the run's pending jobs no longer exclude them. Refused for a node that is not bad, and for one
    Slurm still holds down or drained (its verdict stands: bring it back in Slurm first)."""
    from hpc.driver import exclude_pending
    from hpc.policy.badnodes import bad_nodes, take_back
    from hpc.slurmctl import held_by_slurm

    bad = bad_nodes(rundir)
    unknown = [n for n in nodes if n not in bad]
    if unknown:
        listed = ", ".join(bad) if bad else "none"
        raise VerbError(f"{', '.join(unknown)}: not a bad node of run {rundir.root} (its bad nodes: {listed})")
    held = held_by_slurm(nodes)
    if held:
        verdicts = "; ".join(f"{n} is {v}" for n, v in held.items())
        raise VerbError(
            f"not taken back: Slurm still holds {verdicts}. Return it to service first (scontrol update "
            f"NodeName={','.join(held)} State=RESUME), then run this again."
        )
    for node in nodes:
        take_back(rundir, node, how="by hand (python -m hpc unexclude)")
    left = tuple(n for n in bad if n not in nodes)
    pending = exclude_pending(rundir, left, skip=set())[0] if unfinished(rundir) else []
    where = f"; pending job(s) {', '.join(pending)} now exclude {', '.join(left) or 'nothing'}" if pending else ""
    print(f"taken back: {', '.join(nodes)}; the run's next launch may use them{where}")


def resume(rundir: RunDir, overrides: list[str], *, refresh_code: bool) -> int:
    """Resubmit a finished, failed or cancelled run from its newest checkpoint (``python -m hpc.submit --resume``)."""
    if unfinished(rundir):
        raise VerbError(f"run {rundir.root} still has an unfinished job; `release` or `cancel` it first.")
    rundir.pause_marker.unlink(missing_ok=True)
    from hpc.submit import main as submit_main

    refresh = ["--refresh-code"] if refresh_code else []
    return submit_main(["--resume", str(rundir.root), *set_arguments(overrides), *refresh])
