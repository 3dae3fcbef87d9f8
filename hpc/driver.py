"""The process a Slurm job runs (once, in the batch step): start the ranks, then finish, requeue or give up.

submitit pickles a ``Driver`` and calls it on the first node of the allocation. The ranks are one ``srun`` step
(``srun --mpi=PLUGIN python -m trainer``), so the scheduler's signal (sent to job steps, not the batch shell)
reaches every rank, and the trainer stops at a step boundary with a committed checkpoint and exit status 75.
Only then does the driver requeue the job, and only for the job's own signal: a stop by SIGTERM is Slurm ending
the job (scancel must stay cancelled; scontrol requeue and preemption requeue it themselves). How the launch ended
is read from the run directory (hpc/policy/outcome.py), not from srun's status alone. A cap on requeues stops
endless loops. A launch that failed through no fault of the input (a rank killed or crashed, a hang) is restarted
in the allocation, up to job.max_failures times per run; what follows every launch is hpc/policy/decide.py's
decision, the same for every launcher. A job of a chain whose run is already complete ends at once.

Bad nodes (hpc/policy/badnodes.py) are left out of every launch: srun runs on the allocation's other nodes (at
least job.min_nodes), and when too few are left the run continues in a new job submitted with ``--exclude``
(Slurm cannot change a running job's exclusions, and a requeued job could land on the same node). The driver's
own evidence of who failed first is srun's first "task N: Killed / Exited" line, used when the trainer left no
diagnosis naming ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpc import runlock, slurmctl
from hpc.jobs import exclude_pending, never_requeue, record_job
from hpc.local import memory_of, trainer_command, trainer_environment
from hpc.mpi import find_launcher
from hpc.policy.badnodes import bad_nodes, record_bad_node, recorded, usable_nodes
from hpc.policy.decide import Situation
from hpc.policy.outcome import Ended, how_it_ended, launch_events, new_launch_id
from hpc.restarts import take_back_due_nodes, until_settled
from hpc.slurmctl import FAILED_STATES, describe, held_by_slurm, node_states
from hpc.spares import Spares, keeper_address
from hpc.sweep import element_ended
from runconfig import RunConfig, load_config
from rundir import RunDir
from rundir.contract import EVENT_REJOIN, EVENT_RESUME, EVENT_START, EXIT_DONE, EXIT_STOPPED, SPAWN_WORLD_VAR
from rundir.paths import read_jsonl
from rundir.slurmvars import slurm_job_id, slurm_job_nodes, slurm_queue_id, slurm_restart_count

PLUGIN_FOR_FLAVOUR = {"mpich": "pmi2", "openmpi": "pmix"}


@dataclass(frozen=True)
class SlurmJob:
    """The SLURM_* variables the driver needs, read in one place."""

    job_id: str
    restart_count: int
    queue_id: str = ""  # as squeue names it: ARRAY_TASK for an array's task
    num_nodes: int = 1
    nodelist: str = ""  # SLURM_JOB_NODELIST, compressed (n[1-4])

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> SlurmJob:
        environ = dict(os.environ if environ is None else environ)
        num_nodes, nodelist = slurm_job_nodes(environ)
        return cls(
            job_id=slurm_job_id(environ) or "",
            queue_id=slurm_queue_id(environ) or "",
            restart_count=slurm_restart_count(environ) or 0,
            num_nodes=num_nodes or 1,
            nodelist=nodelist,
        )

    def nodes(self) -> tuple[str, ...]:
        """The allocation's node names, in Slurm's order."""
        return slurmctl.hostnames(self.nodelist)


def mpi_plugin(cfg: RunConfig) -> str:
    if cfg.job.mpi != "auto":
        return cfg.job.mpi
    return PLUGIN_FOR_FLAVOUR[find_launcher().flavour]


def srun_command(cfg: RunConfig, rundir: RunDir, nodes: tuple[str, ...] = ()) -> list[str]:
    """The ranks' step; ``nodes``: run on these nodes of the allocation only (the others are bad)."""
    # The job's SLURM_NTASKS would ask for every rank of the allocation: the step's task count is given too.
    count = len(nodes) * cfg.job.ranks_per_node
    placement = [f"--nodes={len(nodes)}", f"--ntasks={count}", f"--nodelist={','.join(nodes)}"] if nodes else []
    # --overlap: a step whose node was lost can stay RUNNING in slurmctld, holding its CPUs on the live nodes long
    # after its processes there ended; the restart's step must not queue behind it. The driver runs one step of
    # ranks at a time, so nothing is shared in fact.
    # With job.spare_ranks the ranks are no MPI processes and a task's death must not end the others: a spare takes
    # its place (hpc/spares.py).
    spares = bool(cfg.job.spare_ranks)
    return [
        "srun",
        "--mpi=none" if spares else f"--mpi={mpi_plugin(cfg)}",
        f"--kill-on-bad-exit={0 if spares else 1}",
        *(["--no-kill"] if spares else []),  # a lost node's tasks end neither the step nor the survivors
        "--overlap",
        f"--ntasks-per-node={cfg.job.ranks_per_node}",
        *placement,
        *cfg.job.srun_args,
        *trainer_command(rundir, cfg.job.launch_prefix),
    ]


def spare_commands(cfg: RunConfig, rundir: RunDir, nodes: tuple[str, ...]) -> list[list]:
    """The warm spares' (node, command line) pairs (job.spare_ranks), used in turn by the keeper: an srun step of one
    task on each of ``nodes``, the last node first (the first holds the batch step and rank 0)."""
    return [[node, ["srun", "--overlap", "--mpi=none", "--kill-on-bad-exit=0", "--nodes=1", "--ntasks=1",
                    f"--nodelist={node}", *cfg.job.srun_args, *trainer_command(rundir, cfg.job.launch_prefix)]]
            for node in reversed(nodes)]  # fmt: skip


#: srun's line for tasks that ended badly: "srun: error: n2: task 3: Killed", "... tasks 0-1: Exited with exit code 1"
SRUN_TASK_ERROR = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (.+)$")
#: srun's line when slurmctld declares one of the step's nodes failed (not responding for SlurmdTimeout)
SRUN_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (\S+)$")
#: seconds srun may go on after the ranks recorded their diagnosis: a lost node's tasks never report, and srun
#: would wait for them until slurmctld declares the node failed (SlurmdTimeout)
STEP_GRACE_S = 5.0
#: seconds srun may go on after the launch recorded its end (done or stopped) with job.spare_ranks, beyond the
#: tracker's flush
ENDED_GRACE_S = 30.0


@dataclass(frozen=True)
class SrunStepEnd:
    status: int  # srun's exit status (-9: the driver ended it after the grace)
    first_failed: int | None = None  # the task of srun's first failed-task line
    failed_nodes: tuple[str, ...] = ()  # nodes srun reported failed
    ended_srun: bool = False  # the driver ended srun after the ranks' diagnosis


def task_numbers(text: str) -> set[int]:
    """srun's task list ("3", "0-1", "0,2-3") as numbers."""
    out: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            out.update(range(int(first), int(last or first) + 1))
    return out


def suspect_ranks(failure: Path) -> set[int]:
    """The ranks the diagnosis in ``failure`` names (failure.json's suspects)."""
    try:
        suspects = json.loads(failure.read_text()).get("suspects", [])
        return {int(s["rank"]) for s in suspects if isinstance(s, dict) and isinstance(s.get("rank"), int)}
    except (OSError, ValueError, TypeError, KeyError):
        return set()


def run_srun_step(
    command: list[str],
    env: dict,
    failure: Path | None = None,
    ntasks: int = 0,
    recorded: Callable[[], bool] | None = None,
    ended_grace_s: float = 0.0,
) -> SrunStepEnd:
    """Run srun, copying its output through; how it ended.

    srun's first failed-task line comes within ~0.1 s of a rank's death. Once the ranks have written their
    diagnosis (``failure``: they ended the launch themselves, naming the ranks at fault), srun is ended as soon as
    every one of its ``ntasks`` tasks has either reported its end or been named in the diagnosis, and at the latest
    STEP_GRACE_S later: it would wait for the tasks of a lost node, which never report. With ``recorded``
    (job.spare_ranks: whether the launch recorded its end), srun still running ``ended_grace_s`` after that record is
    ended too: a task the keeper counted dead (stopped, cut off) would keep it waiting."""
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
    first: list[int] = []
    failed: list[str] = []
    ended: set[int] = set()  # tasks srun reported ended (badly: a clean exit has no line)

    def copy() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            m = SRUN_TASK_ERROR.match(line.strip())
            if m:
                tasks = task_numbers(m.group(2))
                if not first and tasks:
                    first.append(min(tasks))
                ended.update(tasks)
            m = SRUN_NODE_FAILURE.match(line.strip())
            if m and m.group(1) not in failed:
                failed.append(m.group(1))

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    diagnosed: float | None = None
    named: set[int] = set()
    ended_srun = False
    ended_at: float | None = None  # when the launch's end was first seen recorded
    looked = 0.0
    while True:
        try:
            status = proc.wait(timeout=0.25)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if recorded is not None and ended_at is None and now - looked > 1.0:
            looked = now
            ended_at = now if recorded() else None
        if ended_at is not None and now - ended_at > ended_grace_s:
            print(f"the launch recorded its end and srun still waits {ended_grace_s:g} s later (a task counted dead "
                  "by the keeper): ending srun", flush=True)  # fmt: skip
            proc.kill()
            ended_srun, ended_at = True, None
            recorded = None
        if failure is None:
            continue
        if diagnosed is None and failure.exists():  # written whole (atomically): its suspects are read once
            diagnosed, named = time.monotonic(), suspect_ranks(failure)
        if diagnosed is None:
            continue
        waited = time.monotonic() - diagnosed
        accounted = ntasks > 0 and ended | named >= set(range(ntasks))
        if accounted or waited > STEP_GRACE_S:
            why = "every other task has ended" if accounted else f"srun still waits {STEP_GRACE_S:g} s later"
            print(f"the ranks recorded their diagnosis and {why} (the named ranks' tasks may never report: a "
                  "lost node's): ending srun", flush=True)  # fmt: skip
            proc.kill()
            ended_srun = True
            failure = None
    thread.join(timeout=10)
    return SrunStepEnd(status, first[0] if first else None, tuple(failed), ended_srun)


def sweep_command(nodes: tuple[str, ...], memory: tuple[str, str] | None = None) -> list[str]:
    """One task per node of ``nodes`` removing the shared-memory segments killed ranks left
    (hpc/shmsweep.py), and with ``memory`` (checkpoint.memory_dir, run id) the run's checkpoints in node memory; it
    shares the nodes with whatever still runs there (a lost node, left out, would keep the step from starting)."""
    extra = ["--memory-dir", memory[0], "--run-id", memory[1]] if memory else []
    return [
        "srun",
        "--overlap",
        "--mpi=none",
        f"--nodes={len(nodes)}",
        f"--nodelist={','.join(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        sys.executable,
        "-m",
        "hpc.shmsweep",
        *extra,
    ]


def run_complete(rundir: RunDir, cfg: RunConfig) -> bool:
    """Trained to the end, or pruned at a rung (a sweep element that ended for good)."""
    try:
        summary = json.loads(rundir.summary.read_text())
        return summary["final_step"] >= cfg.train.steps or bool(summary.get("pruned"))
    except (OSError, ValueError, KeyError, TypeError):
        return False


@dataclass(frozen=True)
class SrunLaunch:
    """How one srun step of the ranks ended (hpc/restarts.py's Launched)."""

    ended: Ended
    launch_id: str
    status: int  # srun's exit status
    nodes: tuple[str, ...]
    first_ended: int | None = None  # from srun's first failed-task line
    failed_nodes: tuple[str, ...] = ()  # srun's "Node failure on N" lines


@dataclass(frozen=True)
class Driver:
    run_dir: str
    last_in_chain: bool = True  # earlier jobs of a chain leave the continuation to the next one
    lock_token: str = ""  # the submission's hold on the run (hpc/runlock.py), which this job takes over

    def __call__(self) -> dict:
        # submitit's own handlers would checkpoint and requeue from inside a handler: the ranks handle the
        # stop themselves, and a stray signal to the batch step must neither requeue nor kill the driver.
        # The driver notes the signal: a rank it kills before the rank's handler is in place ends the launch as a
        # stop, not as evidence against the rank's node.
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, _note_stop_signal)
        rundir = RunDir(Path(self.run_dir))
        job = SlurmJob.from_environ()
        problem = rundir.owner_error()
        if problem:
            raise RuntimeError(problem)
        try:  # refused while another launch trains the run (another job of a plain sbatch, a local launch)
            runlock.join(rundir, job.queue_id, self.lock_token)
        except runlock.RunLocked as exc:
            raise RuntimeError(f"job {job.job_id} ends without work: {exc}") from None
        cfg = load_config(str(rundir.config))
        if cfg.job.signal not in ("SIGUSR1", "SIGUSR2", "SIGTERM"):  # the job's own stop signal too
            signal.signal(getattr(signal, cfg.job.signal), _note_stop_signal)
        # SIGTERM to the batch step: Slurm is ending the job (scancel, the time limit, a preemption that requeues
        # it itself). The ranks get it too; the driver only notes it, so that it neither restarts nor resubmits.
        signal.signal(signal.SIGTERM, _note_job_ending)
        os.umask(0o077)
        if run_complete(rundir, cfg):
            print(f"run {rundir.root} is already complete; job {job.job_id} ends without work", flush=True)
            return {"status": "complete"}
        if job.restart_count and cfg.job.exclude_bad_nodes:
            note_lost_nodes(rundir, job)
        take_back_due_nodes(rundir, cfg.job, held_by_slurm)
        allocation = job.nodes()
        usable = usable_nodes(rundir, allocation)[: cfg.job.nodes]
        if allocation and len(usable) < cfg.job.min_nodes_or_all:
            # A job submitted before a node was named (a chain link, a release) got it: continue without it.
            exclude = tuple(bad_nodes(rundir))
            return self._resubmit(cfg, rundir, job, exclude, "this job's allocation holds bad node(s) of the run")
        decision, launched = until_settled(
            rundir,
            cfg.job,
            usable or allocation,
            lambda nodes, attempt: self._launch(cfg, rundir, job, allocation, nodes, attempt),
            lambda launched: self._situation(cfg, job, allocation, launched),
        )
        return self._carry_out(decision, launched, cfg, rundir, job)

    def _situation(self, cfg: RunConfig, job: SlurmJob, allocation: tuple[str, ...], launched: SrunLaunch) -> Situation:
        return Situation(
            slurm=True,
            ending=JOB_ENDING.is_set(),
            requeues=job.restart_count,
            last_in_chain=self.last_in_chain,
            nodes=allocation,
            launch_nodes=launched.nodes,
            ranks_per_node=cfg.job.ranks_per_node,
            first_ended=launched.first_ended,
            failed_nodes=launched.failed_nodes,
            stop_signal=STOP_SIGNAL.is_set(),
        )

    def _carry_out(self, decision, launched: SrunLaunch, cfg: RunConfig, rundir: RunDir, job: SlurmJob) -> dict:
        """What the launches' decision says once no restart follows: resubmit, requeue (held), or end."""
        memory = memory_of(cfg, rundir)
        if decision.action != "restart" and (launched.ended.how == "failed" or memory):
            # Ranks killed or dead in MPI_Init leave shared memory on their nodes: remove it on every node (a
            # restarted launch does that itself, on each node, as it starts); with no launch left in this job, the
            # run's checkpoints in node memory go too.
            # every node of the allocation but those the launch lost and the run's bad nodes (one that is gone
            # keeps the step from starting): earlier launches' nodes may hold the run's memory checkpoints too
            left_out = {*launched.failed_nodes, *bad_nodes(rundir)}
            alive = tuple(n for n in job.nodes() if n not in left_out) or launched.nodes
            self._sweep(cfg, alive, memory)
        if decision.action == "resubmit":
            return self._resubmit(cfg, rundir, job, decision.exclude, decision.message)
        if decision.action in ("requeue", "requeuehold"):
            print(f"{decision.message}; scontrol {decision.action} {job.job_id}", flush=True)
            # Requeueing from inside the job ends it at once: everything is already committed.
            try:
                slurmctl.requeue(job.job_id, hold=decision.action == "requeuehold")
            except slurmctl.SlurmError as exc:
                print(f"warning: {exc}", flush=True)
            return {"status": decision.action}
        print(decision.message, flush=True)
        _sweep_results(rundir, "failed" if decision.error else None)
        if decision.error:
            raise RuntimeError(decision.message.removeprefix("error: "))
        return {"status": launched.ended.how}

    @staticmethod
    def _launch(
        cfg: RunConfig, rundir: RunDir, job: SlurmJob, allocation: tuple[str, ...], nodes: tuple[str, ...], attempt: int
    ) -> SrunLaunch:
        """One srun step of the ranks on ``nodes`` (all of the allocation: no node list); how it ended."""
        if attempt:  # a node named or taken back since the chain's pending links were submitted: their exclusions
            exclude_pending(rundir, tuple(bad_nodes(rundir)), skip={job.job_id})
        nodes = nodes if len(nodes) < len(allocation) else ()
        command = srun_command(cfg, rundir, nodes)
        suffix = f"-r{attempt}" if attempt else ""
        launch_id = new_launch_id(f"slurm-{job.job_id}.{job.restart_count}{suffix}")
        print(f"job {job.job_id} (restart {job.restart_count}, launch {launch_id}): {' '.join(command)}", flush=True)
        env = trainer_environment(cfg, simulate_nodes=False, launch_id=launch_id)
        rundir.clear_failure()  # an earlier launch's diagnosis is not this one's
        STOP_SIGNAL.clear()  # a signal before this launch is not what ends it
        ntasks = len(nodes or allocation) * cfg.job.ranks_per_node
        spares = None
        if cfg.job.spare_ranks:  # the keeper on this (the batch) host, its spares on the launch's nodes
            env[SPAWN_WORLD_VAR] = str(ntasks)
            spares = Spares(cfg, rundir, env, ntasks, spare_commands(cfg, rundir, nodes or allocation),
                            addr=keeper_address(cfg))  # fmt: skip
        try:
            recorded = (lambda: how_it_ended(rundir, launch_id, -1).recorded) if spares is not None else None
            # after the record: rank 0 still flushes the tracker, then every rank meets for the teardown
            grace = ENDED_GRACE_S + (cfg.tracking.flush_timeout_s if cfg.tracking.backend not in ("off", False) else 0)
            end = run_srun_step(command, env, rundir.failure, ntasks, recorded, grace)
        except BaseException:
            if spares is not None:
                spares.kill()
            raise
        if spares is not None:
            spares.finish()
            record_lost_in_place(rundir, launch_id, job.job_id)
        status = end.status
        # The run directory says how the launch ended; srun's status alone misreads a stop whose slower ranks were
        # killed by --kill-on-bad-exit while tearing down after the checkpoint was committed.
        ended = how_it_ended(rundir, launch_id, status)
        if ended.recorded and status not in (EXIT_DONE, EXIT_STOPPED):
            print(f"srun exit status {status}, but this launch recorded: {ended.how}", flush=True)
        return SrunLaunch(ended, launch_id, status, nodes or allocation, end.first_failed, end.failed_nodes)

    def _resubmit(self, cfg: RunConfig, rundir: RunDir, job: SlurmJob, exclude: tuple[str, ...], why: str) -> dict:
        """End this job; the run continues in a job that excludes ``exclude``: the chain's next link when one is
        pending (it starts once this job ends: a new job beside it would train the same run at the same time), with
        the exclusion added to it and every later link, else a new job submitted with ``--exclude``."""
        # This job ends for the other one: Slurm must not requeue it too (a node lost during the job makes it a
        # NODE_FAIL that Slurm requeues once the node is DOWN, and the two jobs would train the run at once).
        never_requeue(job.job_id)
        pending, refused = exclude_pending(rundir, exclude, skip={job.job_id})
        if pending and pending[0] not in refused:
            print(
                f"{why}; the run continues in job {pending[0]}, the chain's next link (--exclude={','.join(exclude)})",
                flush=True,
            )
            return {"status": "resubmitted", "job_id": pending[0]}
        try:
            new_id = submit_link(cfg, rundir, last_in_chain=self.last_in_chain, exclude=exclude, reason="exclude",
                                 lock_token=self.lock_token)  # fmt: skip
            runlock.hand_over(rundir, None, [new_id])
        except Exception as exc:  # sbatch refused (say, too few nodes left in the partition): the run ends here
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise RuntimeError(
                f"{why}; submitting the continuation without {', '.join(exclude)} failed: {message}. Continue with: "
                f"python -m hpc resume {rundir.root}"
            ) from None
        print(f"{why}; the run continues in job {new_id} (--exclude={','.join(exclude)})", flush=True)
        return {"status": "resubmitted", "job_id": new_id}

    @staticmethod
    def _sweep(cfg: RunConfig, nodes: tuple[str, ...], memory: tuple[str, str] | None) -> None:
        try:
            env = trainer_environment(cfg, simulate_nodes=False)
            subprocess.run(sweep_command(nodes, memory), env=env, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"warning: the shared-memory sweep after the failed launch did not finish: {exc}", flush=True)


def record_lost_in_place(rundir: RunDir, launch_id: str, job_id: str) -> list[str]:
    """job.spare_ranks: the nodes whose ranks the keeper counted dead for their silence during the launch (replaced
    by spares in the same processes: the ``rejoin`` events' lost_nodes) named bad nodes, so that later launches
    leave them out."""
    known, named = recorded(rundir), []
    for event in launch_events(rundir, launch_id):
        if event.get("event") != EVENT_REJOIN:
            continue
        for node in event.get("lost_nodes") or []:
            evidence = (f"its rank(s) among {event.get('dead')} were unheard for monitor.peer_timeout_s and were "
                        f"replaced by warm spares in generation {event.get('gen')} of launch {launch_id}")  # fmt: skip
            record_bad_node(rundir, str(node), reason="node lost (silent)", evidence=evidence, launch=launch_id,
                            known=known, slurm_job_id=job_id)  # fmt: skip
            print(f"node {node} was lost during the launch (its ranks replaced in place): left out from now on",
                  flush=True)  # fmt: skip
            named.append(str(node))
    return named


def note_lost_nodes(rundir: RunDir, job: SlurmJob) -> list[str]:
    """A requeued job (Slurm ended the last one with NODE_FAIL, or a requeue after a stop): the nodes the run's last
    launch ran on that Slurm now holds failed are the run's bad nodes, with Slurm's state and reason as evidence
    (Slurm itself keeps this job off them while they are down; later jobs of the run exclude them)."""
    launches = [e for e in read_jsonl(rundir.history) if e.get("event") in (EVENT_START, EVENT_RESUME)]
    if not launches or not launches[-1].get("nodes"):
        return []
    last = launches[-1]
    known, events = set(bad_nodes(rundir)), recorded(rundir)
    lost = []
    for node, (state, reason) in node_states([str(n) for n in last["nodes"]]).items():
        if node in known or not state & FAILED_STATES:
            continue
        held = describe(state, reason)
        evidence = f"Slurm holds it {held} since the run's last launch on it"
        launch = str(last.get("launch", ""))
        record_bad_node(rundir, node, reason="node failure (Slurm)", evidence=evidence, launch=launch,
                        known=events, slurm_job_id=job.job_id)  # fmt: skip
        print(f"node {node} of the run's last launch is {held}: left out from now on", flush=True)
        lost.append(node)
    return lost


def _sweep_results(rundir: RunDir, state: str | None) -> None:
    """A sweep element that ended: the sweep's results rewritten; the table printed once every element ended."""
    try:
        table = element_ended(rundir, state)
    except Exception as exc:  # the run's own outcome is decided: the table is an extra
        print(f"warning: the sweep's results were not written: {exc}", flush=True)
        return
    if table:
        print(table, flush=True)


JOB_ENDING = threading.Event()
STOP_SIGNAL = threading.Event()


def _note_stop_signal(signum: int, frame: object) -> None:
    STOP_SIGNAL.set()


def _note_job_ending(signum: int, frame: object) -> None:
    JOB_ENDING.set()


def submit_link(
    cfg: RunConfig,
    rundir: RunDir,
    *,
    last_in_chain: bool = True,
    dependency: str | None = None,
    exclude: tuple[str, ...] = (),
    chain: tuple[int, int] = (0, 1),
    reason: str = "",
    lock_token: str = "",
) -> str:
    """Submit one job of the run (a Driver), record it in jobs.jsonl, keep its script; the job id."""
    from hpc.slurm import make_executor

    executor = make_executor(cfg, rundir, dependency=dependency, exclude=exclude)
    submitted = executor.submit(Driver(str(rundir.root), last_in_chain=last_in_chain, lock_token=lock_token))
    shutil.copyfile(submitted.paths.submission_file, rundir.job_script(submitted.job_id))
    record_job(rundir, submitted.job_id, chain=chain, exclude=exclude, reason=reason)
    return submitted.job_id
