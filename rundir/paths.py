"""The run-directory layout, the one contract shared by ``hpc`` (writes it) and ``trainer`` (fills it)."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rundir.identity import ensure_identity
from storage.private import user_name


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        """The fully resolved config the trainer reads."""
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        """One JSON object per logged step (rank 0)."""
        return self.root / "metrics.jsonl"

    @property
    def metrics_discarded(self) -> Path:
        """Records of steps computed and then thrown away (after the restored checkpoint, moved here on resume)."""
        return self.root / "metrics.discarded.jsonl"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files (rank 0)."""
        return self.root / "tensorboard"

    @property
    def summary(self) -> Path:
        """Written once at the end of a completed run."""
        return self.root / "summary.json"

    @property
    def allreduce_plan(self) -> Path:
        """comm.allreduce=auto: the plan measured at the run's start (trainer/parallel/autotune.py); comm.plan_from
        of another run may name this run directory to use it."""
        return self.root / "allreduce_plan.json"

    @property
    def failure(self) -> Path:
        """A user error found by the trainer: {"rank": ..., "message": ...}."""
        return self.root / "failure.json"

    @property
    def history(self) -> Path:
        """One JSON line per event of the run's life: start, resume (with Slurm ids), stopped, done."""
        return self.root / "history.jsonl"

    @property
    def pause_marker(self) -> Path:
        """Present while the run is paused: a stopped job is requeued held instead of running again."""
        return self.root / "PAUSED"

    @property
    def jobs(self) -> Path:
        """One JSON line per submitted Slurm job (id, chain position, time), written by the login-node side."""
        return self.root / "jobs.jsonl"

    @property
    def logs(self) -> Path:
        """One log file per rank, plus the launcher's."""
        return self.root / "logs"

    @property
    def code(self) -> Path:
        """The recipe's code snapshot taken at submit time (its package or module, and manifest.json); every launch
        checks it and imports the recipe from here (rundir/snapshot.py)."""
        return self.root / "code"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def record(self) -> Path:
        """What each submission was and what each launch ran on (rundir/record.py)."""
        return self.root / "record"

    @property
    def tracking(self) -> Path:
        """The tracker run's id and how far the tracker has the metrics (tracking/)."""
        return self.root / "tracking.json"

    @property
    def slurm_output(self) -> Path:
        """submitit's folder: each job's batch script, pickled Driver and the driver's own output."""
        return self.root / "slurm"

    @property
    def launcher_log(self) -> Path:
        """The local launcher's (mpirun's) output."""
        return self.logs / "mpirun.log"

    @property
    def stop_budget(self) -> Path:
        """What a stop cost, measured at the last stop (rundir/stopsignal.py)."""
        return self.root / "stop_budget.json"

    def signal_record(self, node: int) -> Path:
        """How a stop signal reaches each rank of ``node`` (its index in the launch): their process chains, written
        at start by the node's first rank (trainer/loop/stopreport.py). One file a node, not a rank: 4,096 ranks
        made 4,096 files a launch."""
        return self.logs / f"signal_node_{node:05d}.json"

    def signal_records(self) -> dict[int, dict]:
        """{rank: its signal record} from every node's file; a file that is not one (unreadable, misnamed, not a
        node's list of records) is left out."""
        out: dict[int, dict] = {}
        for path in sorted(self.logs.glob("signal_node_*.json")):
            try:
                data = json.loads(path.read_text())
                if path != self.signal_record(int(data["node"])):
                    continue
                out.update({int(r["rank"]): r for r in data["records"] if isinstance(r, dict)})
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    @property
    def data_skips(self) -> Path:
        """Data windows a loss spike's rollback skips (trainer/loop/spikes.py)."""
        return self.root / "data_skips.json"

    @property
    def profile(self) -> Path:
        """torch.profiler traces (monitor.profile_steps)."""
        return self.root / "profile"

    @property
    def report(self) -> Path:
        """`python -m hpc report`'s report.md and figures (by default)."""
        return self.root / "report"

    @property
    def tracking_lock(self) -> Path:
        """Held (flock) by the process that sends to the tracker, so that a report does not send beside a launch."""
        return self.root / ".tracking.lock"

    @property
    def identity(self) -> Path:
        """The run's id and key (rundir/identity.py): made with the directory, read by rank 0 for checkpoints."""
        return self.root / "identity.json"

    @property
    def lock(self) -> Path:
        """Who trains the run now (hpc/runlock.py): a local launch's process, or the run's Slurm jobs."""
        return self.root / "lock.json"

    @property
    def lock_guard(self) -> Path:
        """flock-ed for the moment a launch reads and writes ``lock``."""
        return self.root / ".lock"

    def job_script(self, job_id: str) -> Path:
        """The batch script a Slurm job of the run was submitted with (kept for `hpc selftest` and by hand)."""
        return self.root / f"job_{job_id}.sbatch"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank_{rank:05d}.log"

    def write_failure(self, rank: int, message: str, kind: str, suspects: list[dict] | None = None) -> None:
        """Record the trainer's diagnosis for the launcher and status: the rank that found it, the message, its kind
        (rundir/contract.py FAILURE_*: bad input is never retried) and the ranks it points at, each
        ``{"rank": r, "node": NODE, "why": ...}`` (NODE: the Slurm node name, else the host; the launcher leaves
        those nodes out of the next launch, hpc/policy/badnodes.py)."""
        record = {"rank": rank, "message": message, "kind": kind}
        if suspects:
            record["suspects"] = suspects
        # Whole or absent, and the first one stays: several ranks may report, a rank may be killed while it writes
        # (the job aborted), and a later report is a consequence (a rank that declared a hang ended; a survivor's
        # collective then failed), never the cause. The launch's launcher removed any earlier launch's record.
        # (Per thread: a rank's watchdog thread and main thread may both report.)
        tmp = self.failure.with_name(f".{self.failure.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(json.dumps(record) + "\n")
        try:
            os.link(tmp, self.failure)  # atomic, and refused where a record exists
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)

    def clear_failure(self) -> None:
        """Remove an earlier launch's diagnosis, and what a rank killed while writing one left behind."""
        self.failure.unlink(missing_ok=True)
        for partial in self.root.glob(f".{self.failure.name}.tmp-*"):
            partial.unlink(missing_ok=True)

    def failure_record(self) -> dict:
        """failure.json as written by ``write_failure``; {} when there is none (or it cannot be read)."""
        try:
            record = json.loads(self.failure.read_text())
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def failure_message(self) -> str | None:
        """The trainer's diagnosis in failure.json (bad input, a hang, a rank gone), if there is one."""
        message = self.failure_record().get("message")
        return None if message is None else str(message)

    def owner_error(self) -> str | None:
        """None when the run directory (if it exists) and its config are this user's and no one else may write
        them, else what is wrong (one line): a folder someone else made or can write would run their recipe and
        config with this user's credentials."""
        uid = os.geteuid()
        for path in (self.root, self.config):
            try:
                st = os.stat(path) if path == self.root else os.lstat(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                return f"run directory {self.root} cannot be checked ({path}: {exc.strerror or exc})"
            if path != self.root and not stat.S_ISREG(st.st_mode):
                return f"run directory {self.root}: {path.name} is not a regular file (a link?); refused"
            if st.st_uid != uid:
                return (
                    f"run directory {self.root} is not yours ({path} belongs to {user_name(st.st_uid)}, you are "
                    f"{user_name(uid)}): refused, nothing run or written. Choose a directory of your own."
                )
            if st.st_mode & 0o022:
                return (
                    f"run directory {self.root}: {path} may be written by others (mode {stat.S_IMODE(st.st_mode):o}): "
                    f"refused, nothing run or written. Make it private: chmod 700 {self.root}"
                )
        return None

    def writable_error(self) -> str | None:
        """None when the run directory is the user's (``owner_error``) and it and its sub-folders accept new files,
        else what is wrong (one line)."""
        problem = self.owner_error()
        if problem:
            return problem
        for path in (self.root, self.logs, self.checkpoints):
            try:
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
                probe = path / f".write-probe-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as exc:
                return f"run directory {self.root} is not writable ({path}: {exc.strerror or exc})"
        return None

    def create(self) -> None:
        """Create the layout, private to the user (run directories hold pickles and configs)."""
        for path in (self.root, self.logs, self.checkpoints):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(path, 0o700)
        ensure_identity(self.identity)


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file of a run directory (metrics, history, jobs), skipping unparsable
    lines (a line cut short by a kill or a full disk); [] when the file does not exist."""
    return list(iter_jsonl(path))


def iter_jsonl(path: Path) -> Iterator[dict]:
    """``read_jsonl``'s objects one at a time, the file read as they are taken (a long metrics.jsonl)."""
    try:
        f = open(path, errors="replace")  # noqa: SIM115 (closed below, also when the caller stops early)
    except FileNotFoundError:
        return
    with f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj
