"""Slurm submission through submitit (torch-free): the job section of the config -> sbatch parameters.

The generated batch script runs one *driver* process (``hpc.driver``, no srun around it); the driver starts the
ranks with ``srun --mpi=PLUGIN python -m trainer`` and decides what happens when they stop: done, requeue (after
the trainer committed its checkpoint), or give up. Every config value that reaches the script was validated in
``runconfig.schema.slurm_syntax`` (through ``JobConfig.check``) or is quoted here.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from runconfig import RunConfig
from runconfig.schema.slurm_syntax import SLURM_NAMES_RE
from rundir import RunDir

SIGNAL_PREFIX = "SIG"


def slurm_folder(rundir: RunDir) -> Path:
    """submitit's folder (pickles and logs): private, inside the private run directory."""
    return rundir.slurm_output


def requoted_setup(cfg: RunConfig) -> list[str]:
    """job.setup's lines re-quoted word by word: each runs its command without expanding, substituting or chaining
    anything of the config value (submitit's script and sbatch/common.sh both run these)."""
    return [shlex.join(shlex.split(line)) for line in cfg.job.setup if line.strip()]


def setup_lines(cfg: RunConfig) -> list[str]:
    """Setup lines re-quoted word by word (no expansion of config values), then the environment exports."""
    lines = requoted_setup(cfg)
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(cfg.job.env.items())]
    return lines


def sbatch_parameters(cfg: RunConfig, *, dependency: str | None = None, exclude: tuple[str, ...] = ()) -> dict:
    """Keyword arguments of submitit's SlurmExecutor.update_parameters for this job (``exclude``: the run's bad
    nodes, hpc/policy/badnodes.py)."""
    job = cfg.job
    extra: dict[str, str | bool] = {"signal": f"{job.signal.removeprefix(SIGNAL_PREFIX)}@{job.signal_lead_s}"}
    extra["requeue"] = True  # allow requeue even where the cluster's JobRequeue default is 0
    if job.no_kill:
        extra["no_kill"] = True
    if exclude:
        bad = [n for n in exclude if not SLURM_NAMES_RE.fullmatch(n)]
        if bad:  # names come from Slurm itself; still, nothing unchecked reaches an #SBATCH line
            raise ValueError(f"node names {bad} from the run's history are not valid Slurm node names")
        extra["exclude"] = ",".join(exclude)
    extra.update(job.sbatch_extra)
    params = {
        "job_name": job.name,
        "nodes": job.nodes,
        "ntasks_per_node": job.ranks_per_node,
        "cpus_per_task": job.cpus_per_task,
        "time": job.time_minutes,
        "use_srun": False,  # the driver starts the ranks itself
        "stderr_to_stdout": True,
        "setup": setup_lines(cfg) or None,
        "additional_parameters": extra,
    }
    optional = {
        "gpus_per_node": job.gpus_per_node or None,
        "mem": job.mem,
        "partition": job.partition,
        "account": job.account,
        "qos": job.qos,
        "constraint": job.constraint,
        "exclusive": True if job.exclusive else None,
        "dependency": dependency,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def make_executor(cfg: RunConfig, rundir: RunDir, *, dependency: str | None = None, exclude: tuple[str, ...] = ()):
    import submitit  # imported here: `--dry-run` without Slurm needs no submitit import cost beyond this

    folder = slurm_folder(rundir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    executor = submitit.SlurmExecutor(folder=folder / "%j", max_num_timeout=0)
    executor.update_parameters(**sbatch_parameters(cfg, dependency=dependency, exclude=exclude))
    return executor


def sbatch_script(cfg: RunConfig, rundir: RunDir, *, python: str | None = None) -> str:
    """The batch script submitit submits for this run (printed by --dry-run; saved in the run directory)."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = slurm_folder(rundir) / "%j"
    command = f"{shlex.quote(python or sys.executable)} -u -m submitit.core._submit {shlex.quote(str(folder))}"
    return _make_sbatch_string(command=command, folder=folder, **sbatch_parameters(cfg))


def sbatch_options(cfg: RunConfig, *, exclude: tuple[str, ...] = ()) -> list[str]:
    """The job section as sbatch command-line options, for the plain scripts:
    ``sbatch $(python -m hpc sbatch-args CONFIG) sbatch/train.sbatch`` (they override the scripts' #SBATCH
    defaults, so the signal and its lead, partition, time and GPUs come from the config)."""
    params = sbatch_parameters(cfg, exclude=exclude)
    names = {
        "job_name": "job-name", "nodes": "nodes", "ntasks_per_node": "ntasks-per-node",
        "cpus_per_task": "cpus-per-task", "gpus_per_node": "gpus-per-node", "mem": "mem", "partition": "partition",
        "account": "account", "qos": "qos", "constraint": "constraint",
    }  # fmt: skip
    out = [f"--{flag}={params[key]}" for key, flag in names.items() if key in params]
    minutes = params["time"]
    out.append(f"--time={minutes // 1440}-{minutes % 1440 // 60:02d}:{minutes % 60:02d}:00")
    if params.get("exclusive"):
        out.append("--exclusive")
    for key, value in params["additional_parameters"].items():
        out.append(f"--{key.replace('_', '-')}" if value is True else f"--{key.replace('_', '-')}={value}")
    return out
