"""A run's state as the verbs, `hpc runs`, `hpc report` and a sweep's table see it (torch-free): from the run
directory and its jobs' states; and the verbs' shared error."""

from __future__ import annotations

from pathlib import Path

from hpc.follow import resume_notes
from hpc.jobs import states
from hpc.policy.badnodes import bad_node_events
from hpc.slurmctl import JobState
from runconfig import load_config
from rundir import RunDir
from rundir.checkpoints import latest_committed
from rundir.contract import EVENT_CODE, EVENT_PRUNED, EVENT_RESUME
from rundir.paths import read_jsonl
from rundir.stopsignal import newest_budget


class VerbError(Exception):
    pass


def open_run(path: str) -> RunDir:
    rundir = RunDir(Path(path).absolute())
    if not rundir.config.is_file():
        raise VerbError(f"{path} is not a run directory (it has no config.yaml).")
    return rundir


def _last_metrics(rundir: RunDir) -> dict | None:
    records = read_jsonl(rundir.metrics)
    return records[-1] if records else None


def status(rundir: RunDir, jobs: list[JobState] | None = None) -> dict:
    """``jobs``: the run's job states where the caller asked for several runs' at once."""
    cfg = load_config(str(rundir.config))
    jobs = states(rundir) if jobs is None else jobs
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
        "restarts": sum(1 for e in history if e.get("event") == EVENT_RESUME),
        "step": int(number((last or {}).get("step")) or 0),
        "steps": cfg.train.steps,
        "loss": number((last or {}).get("loss")),
        "checkpoint": {"step": ckpt["step"], "loss": number(ckpt.get("loss"))} if ckpt else None,
        "failure": failure,
        "bad_nodes": [{k: e.get(k) for k in ("node", "evidence", "launch")} for e in bad_node_events(rundir)],
        "stop_lead": {**budget.fields(), "message": budget.describe()} if budget else None,
        "resume_warnings": resume_notes(next((e for e in reversed(history) if e.get("event") == EVENT_RESUME), {})),
    }


def number(value: object) -> float | None:
    """A figure read from a run's files, or None when it is none (a line written by hand, a field cut short)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


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
        if j["source"] == "squeue":
            print(f"  job {j['job_id']}: {j['state']}{reason}, {j['restarts']} requeues")
        elif j["source"] == "sacct":
            note = "from sacct: the controller no longer knows the job"
            print(f"  job {j['job_id']}: {j['state']}{reason}, {j['restarts']} requeues ({note})")
        else:
            print(f"  job {j['job_id']}: {j['state']}{reason}")
