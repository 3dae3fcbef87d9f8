"""The SLURM_* values both sides read (the driver in the batch step, the trainer's ranks), parsed in one place."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

JOB_ID_VAR = "SLURM_JOB_ID"
RESTART_COUNT_VAR = "SLURM_RESTART_COUNT"
PROCID_VAR, NTASKS_VAR = "SLURM_PROCID", "SLURM_NTASKS"
NODE_NAME_VAR = "SLURMD_NODENAME"
JOB_NUM_NODES_VAR, JOB_NODELIST_VAR = "SLURM_JOB_NUM_NODES", "SLURM_JOB_NODELIST"
ARRAY_JOB_VAR, ARRAY_TASK_VAR = "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"
CONF_VAR = "SLURM_CONF"
DEFAULT_CONF = "/etc/slurm/slurm.conf"


def slurm_job_id(environ: Mapping[str, str]) -> str | None:
    """This Slurm job's id; None outside a Slurm job."""
    return environ.get(JOB_ID_VAR) or None


def slurm_queue_id(environ: Mapping[str, str]) -> str | None:
    """This job as squeue names it: ARRAY_TASK (``7_3``) for an array's task, else its id; None outside a job."""
    array, task = environ.get(ARRAY_JOB_VAR), environ.get(ARRAY_TASK_VAR)
    return f"{array}_{task}" if array and task else slurm_job_id(environ)


def slurm_restart_count(environ: Mapping[str, str]) -> int | None:
    """How many times Slurm has requeued this job: 0 on its first run (Slurm sets SLURM_RESTART_COUNT only once the
    job is requeued), None outside a Slurm job."""
    if slurm_job_id(environ) is None:
        return None
    text = environ.get(RESTART_COUNT_VAR, "")
    return int(text) if text.isdigit() else 0


def slurm_task(environ: Mapping[str, str]) -> tuple[int, int]:
    """(this task's index, the step's number of tasks) of a Slurm step; (0, 1) outside one."""
    procid, ntasks = environ.get(PROCID_VAR, ""), environ.get(NTASKS_VAR, "")
    return (int(procid) if procid.isdigit() else 0), (int(ntasks) if ntasks.isdigit() else 1)


def slurm_node_name(environ: Mapping[str, str]) -> str | None:
    """The Slurm node this task runs on (slurmd's name for it); None outside a Slurm step."""
    return environ.get(NODE_NAME_VAR) or None


def slurm_job_nodes(environ: Mapping[str, str]) -> tuple[int | None, str]:
    """(the job's number of nodes, its node list as Slurm compresses it, e.g. ``n[1-4]``); (None, "") outside a job."""
    count = environ.get(JOB_NUM_NODES_VAR, "")
    return (int(count) if count.isdigit() else None), environ.get(JOB_NODELIST_VAR, "")


def slurm_conf(environ: Mapping[str, str]) -> Path:
    """The cluster configuration Slurm's commands read: SLURM_CONF, else Slurm's default path."""
    return Path(environ.get(CONF_VAR) or DEFAULT_CONF)
