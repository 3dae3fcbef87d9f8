"""What may reach a Slurm command line or an ``#SBATCH`` line, and Slurm's own formats (time limits, memory):
the checks behind every job.* value that the generated script carries unquoted."""

from __future__ import annotations

import re

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# What may reach an #SBATCH line unquoted: no spaces, quotes, '$', backticks, ';' or newlines.
SLURM_NAMES_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64})*$")
CONSTRAINT_RE = re.compile(r"^[A-Za-z0-9_.&|,\[\]*:!()-]{1,256}$")
MEM_RE = re.compile(r"^[0-9]+[KMGT]?$")
TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{2}))?(?::(\d{2}))?$")
OPTION_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
OPTION_VALUE_RE = re.compile(r"^[A-Za-z0-9_.,:/=+@%-]{0,256}$")
SRUN_ARG_RE = re.compile(r"^--?[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.,:/=+@%-]*)?$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
SIGNAL_NAMES = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP", "SIGCONT", "SIGXCPU")

Problems = list[tuple[str, str]]


def slurm_minutes(text: str) -> int | None:
    """Minutes in a Slurm time limit, read as Slurm reads it: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
    (seconds round up); None if bad. Two fields without days are minutes:seconds (``25:00`` is 25 minutes)."""
    m = TIME_RE.fullmatch(text)
    if not m:
        return None
    days, first, second, third = m.groups()
    if days is None and third is None and second is None:
        return int(first)  # plain minutes
    if days is None and third is None:
        seconds = int(second)
        return None if seconds > 59 else int(first) + (1 if seconds else 0)
    hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
    if minutes > 59 or seconds > 59:
        return None
    return int(days or 0) * 1440 + hours * 60 + minutes + (1 if seconds else 0)


def single_line_problem(text: str) -> str | None:
    if any(c in text for c in "\n\r\0"):
        return "must be a single line"
    return None


def names_problems(job) -> Problems:
    """The job's name and the Slurm names and formats of partition, account, qos, constraint, mem and time."""
    out: Problems = []
    if not NAME_RE.fullmatch(job.name):
        out.append(("name", f"{job.name!r} must match {NAME_RE.pattern}"))
    for key in ("partition", "account", "qos"):
        value = getattr(job, key)
        if value is not None and not SLURM_NAMES_RE.fullmatch(value):
            out.append((key, f"{value!r} must be names of letters, digits, '_', '.', '-' (comma-separated)"))
    if job.constraint is not None and not CONSTRAINT_RE.fullmatch(job.constraint):
        out.append(("constraint", f"{job.constraint!r} may hold only feature names and & | , [ ] * : ! ( )"))
    if job.mem is not None and not MEM_RE.fullmatch(job.mem):
        out.append(("mem", f"{job.mem!r} must look like 64G, 512M or 1000"))
    minutes = slurm_minutes(job.time)
    if minutes is None or minutes < 1:
        out.append(
            ("time", f"{job.time!r} must be MM, MM:SS, HH:MM:SS or D-HH:MM:SS (as Slurm reads it), at least a minute")
        )
    if job.signal not in SIGNAL_NAMES:
        out.append(("signal", f"{job.signal!r} is not one of {', '.join(SIGNAL_NAMES)}"))
    return out


def words_problems(job) -> Problems:
    """Setup lines, environment variables, srun options, launch-prefix words and extra sbatch options: each
    single-line and, where it reaches a command line unquoted, of safe characters only."""
    out: Problems = []
    for i, line in enumerate(job.setup):
        problem = single_line_problem(line)
        if problem:
            out.append((f"setup[{i}]", f"{line!r} {problem}"))
    for name, value in job.env.items():
        if not ENV_NAME_RE.fullmatch(name):
            out.append((f"env.{name}", "is not a valid environment variable name"))
        elif single_line_problem(value):
            out.append((f"env.{name}", f"{value!r} must be a single line"))
    for i, arg in enumerate(job.srun_args):
        if not SRUN_ARG_RE.fullmatch(arg):
            out.append(
                (
                    f"srun_args[{i}]",
                    f"{arg!r} must look like --option or --option=value (no spaces, quotes or shell characters)",
                )
            )
    for i, word in enumerate(job.launch_prefix):
        if not word or not OPTION_VALUE_RE.fullmatch(word):
            out.append(
                (
                    f"launch_prefix[{i}]",
                    f"{word!r} may hold only letters, digits and _ . , : / = + @ % - (one word: no spaces, quotes "
                    "or shell characters)",
                )
            )
    for key, value in job.sbatch_extra.items():
        if not OPTION_KEY_RE.fullmatch(key):
            out.append((f"sbatch_extra.{key}", "is not a valid sbatch option name"))
        elif not OPTION_VALUE_RE.fullmatch(value):
            out.append((f"sbatch_extra.{key}", f"{value!r} may hold only letters, digits and _ . , : / = + @ % -"))
    return out
