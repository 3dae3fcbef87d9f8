"""``python -m hpc.submit CONFIG``: validate a config, write a private run directory, and start the job.

With no Slurm on this machine (no ``sbatch`` on PATH), or with ``--local``, the job runs here under mpirun with
its nodes simulated on one host. Exit status: 0 done, 2 bad input (one message, no traceback), 1 the job failed.

A new run's recipe module (``recipe: module.path:function``, found next to the config file or in the current
folder) is copied into RUN_DIR/code/ (rundir/snapshot.py): every launch of the run imports that snapshot, so edits
made while the job waits in the queue do not reach it. A resume keeps the snapshot unless ``--refresh-code``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpc import slurmctl
from hpc.driver import submit_link
from hpc.local import (
    LaunchResult,
    node_wraps,
    remove_memory_checkpoints,
    run_local,
    simulated_nodes,
    trainer_command,
)
from hpc.mpi import LauncherError, MpiLauncher, find_launcher
from hpc.options import add_set_option
from hpc.policy.badnodes import bad_nodes, usable_nodes
from hpc.policy.decide import Situation, restarts_so_far
from hpc.restarts import take_back_due_nodes, until_settled
from hpc.runlock import Holder, RunLocked, hand_over, release, take, this_process
from hpc.slurm import sbatch_script
from hpc.slurmctl import held_by_slurm
from runconfig import ConfigError, RunConfig, dump_yaml, load_config
from runconfig.schema import BUILTIN_RECIPE
from rundir import RunDir, record
from rundir import snapshot as codesnap
from rundir.contract import EVENT_CODE, EXIT_FAILED, EXIT_STOPPED, EXIT_USER_ERROR, NODE_WRAP_VAR, append_event
from storage.files import write_atomic


class SubmitError(Exception):
    pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpc.submit", description=__doc__.splitlines()[0])
    p.add_argument(
        "config",
        help="config file, the name of a built-in example (e.g. tiny), or an existing run directory to resume",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="CONFIG is a run directory: continue it from its newest "
        "valid checkpoint (implied when CONFIG is a directory)",
    )
    p.add_argument("--local", action="store_true", help="run on this machine even if Slurm is present")
    p.add_argument("--run-dir", type=Path, help="run directory (default: runs/NAME-YYYYmmdd-HHMMSS)")
    add_set_option(p)
    p.add_argument(
        "--refresh-code",
        action="store_true",
        help="with a resume: copy the recipe's code again from where the run's snapshot was taken (RUN_DIR/code/); "
        "without it a resumed run keeps the code it was submitted with",
    )
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script (or local launch) and exit")
    p.add_argument("--slurm", action="store_true", help="target Slurm even where no sbatch is on PATH (dry runs)")
    p.add_argument(
        "--chain",
        type=int,
        default=1,
        metavar="K",
        help="submit K jobs linked by afterany dependencies, for runs longer than one job's time limit",
    )
    return p.parse_args(argv)


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_run_dir(path: Path, *, default: bool) -> RunDir:
    """A new run's directory: made here (``default``: the first free one of NAME-TIME, NAME-TIME-2, ...: two
    submissions in one second get one each), or an empty one of the user's that --run-dir names."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # a runs folder as the umask makes it (Prometheus reads in it)
        for n in range(1, 1000 if default else 2):
            candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
            try:
                candidate.mkdir(mode=0o700)
                path = candidate
                break
            except FileExistsError:
                if not default:
                    break
        rundir = RunDir(path)
        problem = rundir.owner_error()
        if problem:
            raise SubmitError(problem)
        lock_files = {rundir.lock.name, rundir.lock_guard.name}  # what a concurrent submission may have made there
        if not path.is_dir() or any(p.name not in lock_files for p in path.iterdir()):
            raise SubmitError(f"run directory {path} already exists and is not empty; choose another --run-dir.")
        rundir.create()
    except OSError as exc:
        raise SubmitError(f"run directory {path} cannot be created: {exc.strerror}.") from None
    return rundir


def resume_target(args: argparse.Namespace) -> Path | None:
    """The run directory to continue, when CONFIG names one (or --resume is given)."""
    path = Path(args.config)
    if not (args.resume or path.is_dir()):
        return None
    problem = RunDir(path).owner_error()  # before anything is read from it
    if problem:
        raise SubmitError(problem)
    if not RunDir(path).config.is_file():
        raise SubmitError(f"{path} is not a run directory (it has no config.yaml); nothing to resume.")
    if args.run_dir and Path(args.run_dir).resolve() != path.resolve():
        raise SubmitError("--run-dir cannot be combined with resuming another run directory.")
    return path


def config_search(config: str) -> list[Path]:
    """Where a new run's recipe module is looked for: next to CONFIG when it is a file (a built-in example name
    has no folder of the user's), and in the current folder."""
    return codesnap.search_path(Path(config) if Path(config).is_file() else None)


def snapshot_new_run(rundir: RunDir, recipe: str, search: list[Path]) -> codesnap.Snapshot | None:
    """Copy the recipe's code into a new run directory, say so, and record it in the run's history."""
    snap = codesnap.take(rundir, recipe, search)
    if snap is not None:
        print(f"code snapshot: {snap.module} {snap.sha256[:12]} ({snap.files} files)", flush=True)
        append_event(
            rundir.history, EVENT_CODE, module=snap.module, sha256=snap.sha256, source=snap.source, refreshed=False
        )
    return snap


def refresh_code(rundir: RunDir, recipe: str) -> codesnap.Snapshot | None:
    """``--refresh-code``: take the resumed run's snapshot again, from the folder the old one was taken from (then
    the current folder), and record it in the run's history."""
    old = codesnap.read(rundir)
    search = ([Path(old.source).parent] if old else []) + codesnap.search_path(None)
    snap = codesnap.refresh(rundir, recipe, search)
    if snap is None:
        print(f"code snapshot: none (recipe {recipe} is built in or installed)", flush=True)
        return None
    same = " (unchanged)" if old and old.sha256 == snap.sha256 else ""
    print(f"code snapshot refreshed: {snap.module} {snap.sha256[:12]} ({snap.files} files){same}", flush=True)
    append_event(rundir.history, EVENT_CODE, module=snap.module, sha256=snap.sha256, source=snap.source, refreshed=True)
    return snap


def check_resumed_code(rundir: RunDir, recipe: str) -> None:
    """A resume keeps the run's snapshot; a recipe changed (--set recipe=...) to another top-level module than the
    snapshot's would silently run code that is not in it."""
    snap = codesnap.read(rundir)
    if snap is None or recipe == BUILTIN_RECIPE:
        return
    module = recipe.partition(":")[0].split(".")[0]
    if module != snap.module:
        raise SubmitError(
            f"recipe {recipe} is not in the run's code snapshot ({snap.module}, taken from {snap.source}); add "
            "--refresh-code to take a new snapshot of the recipe's module."
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        planned = plan(args)
        if args.dry_run:
            dry_run(planned, args)
            return 0
        rundir, holder = write_run_dir(planned, args, argv)
    except (ConfigError, SubmitError, LauncherError, RunLocked) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    if planned.launcher is None:
        return submit_slurm(planned.cfg, rundir, chain=args.chain, holder=holder)
    try:
        return run_here(planned, rundir)
    finally:
        release(rundir, holder)


@dataclass(frozen=True)
class Planned:
    """What a submission will do, decided before anything is written."""

    cfg: RunConfig
    run_path: Path
    default_path: bool  # run_path is default_run_dir's: the first free one of its name is taken
    resume: bool
    search: list[Path] | None  # where a new run's recipe module is looked for (None: a resume keeps its snapshot)
    launcher: MpiLauncher | None  # this machine's mpirun; None: Slurm


def plan(args: argparse.Namespace) -> Planned:
    """Read and check everything the submission needs: the config, the target, the recipe's module."""
    resume_dir = resume_target(args)
    if args.refresh_code and not resume_dir:
        raise SubmitError("--refresh-code applies to a resumed run only (--resume RUN_DIR, or a RUN_DIR).")
    cfg = load_config(str(RunDir(resume_dir).config) if resume_dir else args.config, args.overrides)
    use_slurm = args.slurm or (not args.local and slurmctl.available())
    if args.chain < 1:
        raise SubmitError(f"--chain must be >= 1, got {args.chain}.")
    run_path = (resume_dir or args.run_dir or default_run_dir(cfg.job.name)).absolute()
    search = None if resume_dir else config_search(args.config)
    if search is not None:
        codesnap.locate(cfg.recipe, search)  # a recipe module found nowhere is an error before anything is made
    elif not args.refresh_code:
        check_resumed_code(RunDir(run_path), cfg.recipe)
    launcher = None if use_slurm else find_launcher()
    if launcher is not None and not args.dry_run:
        node_wraps(cfg, simulated_nodes(cfg))  # refused here, before the run directory, if malformed
        if cfg.job.spare_ranks and os.environ.get(NODE_WRAP_VAR):
            raise SubmitError(f"job.spare_ranks: the keeper listens on this host's loopback, which ranks wrapped by "
                              f"{NODE_WRAP_VAR} (network namespaces) cannot reach; set job.spare_ranks: 0")  # fmt: skip
    default_path = not (resume_dir or args.run_dir)
    return Planned(cfg, run_path, default_path, bool(resume_dir), search, launcher)


def dry_run(planned: Planned, args: argparse.Namespace) -> None:
    """Print the sbatch script (or the local launch command and the resolved config); create nothing."""
    cfg, rundir = planned.cfg, RunDir(planned.run_path)
    print(f"# run directory: {planned.run_path}")
    sets = [a for kv in args.overrides for a in ("--set", kv)]
    plan_command = shlex.join(["python", "-m", "trainer.plan", str(args.config), *sets])
    print(f"memory per rank, planned without a GPU: {plan_command}", file=sys.stderr)  # stdout: the script alone
    if planned.launcher is None:
        print(sbatch_script(cfg, rundir), end="")
    else:
        command = planned.launcher.command(cfg.job.world_size, trainer_command(rundir, cfg.job.launch_prefix))
        print(f"# launch: {shlex.join(command)}\n{dump_yaml(cfg)}", end="")


def write_run_dir(planned: Planned, args: argparse.Namespace, argv: list[str]) -> tuple[RunDir, Holder]:
    """The run directory, taken for this submission (hpc/runlock.py: refused while another launch trains it), with
    its code snapshot, resolved config and the record of this submission (rundir/record.py); a new one is removed
    again when it cannot be completed."""
    cfg, run_path = planned.cfg, planned.run_path
    created = snap = holder = None
    try:
        if planned.resume:
            rundir = RunDir(run_path)
        else:
            existed = run_path.exists()
            rundir = prepare_run_dir(run_path, default=planned.default_path)
            created = None if existed and not planned.default_path else rundir.root
        problem = rundir.writable_error()
        if problem:
            raise SubmitError(problem + "; nothing was changed.")
        holder = take(rundir, this_process("a local launch" if planned.launcher else "a submission to Slurm"))
        if not planned.resume and rundir.config.exists():  # made by another submission since the check above
            raise SubmitError(f"run directory {rundir.root} was just taken by another submission; choose another.")
        if planned.resume and args.refresh_code:
            snap = refresh_code(rundir, cfg.recipe)
        elif not planned.resume:
            snap = snapshot_new_run(rundir, cfg.recipe, planned.search)
            created = None  # the run directory is complete once its config is written below
        write_atomic(rundir.config, dump_yaml(cfg), fsync=True)
        record.write_submission(rundir.record, record.command_line("hpc.submit", argv), resumed=planned.resume,
                                project_source=snap.source if snap else None)  # fmt: skip
    except (ConfigError, SubmitError, LauncherError, RunLocked):
        if holder is not None:
            release(rundir, holder)
        if created is not None:  # a new run directory left without its code snapshot: remove what was made
            shutil.rmtree(created, ignore_errors=True)
        raise
    return rundir, holder


def run_here(planned: Planned, rundir: RunDir) -> int:
    """The local launch, restarted in place while the decisions say so (hpc/restarts.py); its exit status."""
    cfg, launcher = planned.cfg, planned.launcher
    verb = "resuming" if planned.resume else "starting"
    print(
        f"{verb} {cfg.job.name}: {cfg.job.nodes} simulated nodes x {cfg.job.ranks_per_node} ranks on this machine "
        f"({launcher.flavour}); run directory {rundir.root}",
        flush=True,
    )
    allocation = simulated_nodes(cfg)
    take_back_due_nodes(rundir, cfg.job)
    nodes = usable_nodes(rundir, allocation)
    if len(nodes) < cfg.job.min_nodes_or_all:
        print(
            f"error: run {rundir.root} named simulated node(s) {', '.join(bad_nodes(rundir))} bad; "
            f"{len(nodes)} left, job.min_nodes={cfg.job.min_nodes_or_all}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    try:
        decision, result = until_settled(
            rundir,
            cfg.job,
            nodes,
            lambda use, _attempt: run_local(cfg, rundir, launcher, nodes=use),
            lambda result: Situation(
                slurm=False,
                nodes=allocation,
                launch_nodes=result.nodes,
                ranks_per_node=cfg.job.ranks_per_node,
                first_ended=result.first_ended,
            ),
        )
    except KeyboardInterrupt:
        print(f"\ninterrupted; run directory {rundir.root}", file=sys.stderr)
        return 130
    finally:
        remove_memory_checkpoints(cfg, rundir)  # no launch of this run follows here
    if decision.error and restarts_so_far(rundir):
        print(decision.message, file=sys.stderr)
    return report(rundir, result)


def submit_slurm(cfg, rundir: RunDir, *, chain: int, holder: Holder) -> int:
    """Submit the run as ``chain`` jobs linked by afterany dependencies; each continues from the newest
    checkpoint, and once training is complete the rest end at once without work. The jobs take the run's lock
    over from this submission (``holder``)."""
    os.umask(0o077)  # submitit's job folders, pickles and logs: private like the run directory
    try:
        job_ids = []
        take_back_due_nodes(rundir, cfg.job, held_by_slurm)
        exclude = tuple(bad_nodes(rundir))  # a resumed run never lands on a node it named bad
        for position in range(chain):
            job_id = submit_link(
                cfg,
                rundir,
                last_in_chain=position == chain - 1,
                dependency=f"afterany:{job_ids[-1]}" if job_ids else None,
                exclude=exclude,
                chain=(position, chain),
                lock_token=holder.token,
            )
            job_ids.append(job_id)
    except Exception as exc:  # sbatch refusals come back as submitit/subprocess errors: one clear line
        if job_ids:
            hand_over(rundir, holder, job_ids)
        else:
            release(rundir, holder)
        print(f"error: submitting to Slurm failed: {str(exc).strip().splitlines()[-1]}", file=sys.stderr)
        return EXIT_USER_ERROR
    hand_over(rundir, holder, job_ids)
    print(
        f"submitted {cfg.job.name} as Slurm job{'s' if chain > 1 else ''} {', '.join(job_ids)}: {cfg.job.nodes} "
        f"nodes x {cfg.job.ranks_per_node} ranks; run directory {rundir.root}\n"
        f"follow it with: python -m hpc status {rundir.root}"
    )
    return 0


def report(rundir: RunDir, result: LaunchResult) -> int:
    ended, status = result.ended, result.ended.status
    failure = rundir.failure_message() or result.error_line()
    if ended.how == "stopped" and not failure:
        print(
            f"stopped by a signal with a committed checkpoint; continue with: python -m hpc.submit --resume "
            f"{rundir.root}"
        )
        return EXIT_STOPPED
    if failure:  # diagnosed by the trainer: bad input (status 2), or a hang / a rank gone (the job failed)
        print(f"error: {failure}", file=sys.stderr)
        return EXIT_USER_ERROR if status == EXIT_USER_ERROR else EXIT_FAILED
    if ended.how != "done" or not rundir.summary.exists():
        log = rundir.launcher_log
        print(
            f"error: the job failed (mpirun exit status {status}); its last output (all of it in {log}):",
            file=sys.stderr,
        )
        print("\n".join(result.output_tail[-20:]), file=sys.stderr)
        return EXIT_FAILED
    summary = json.loads(rundir.summary.read_text())
    eval_part = f", eval loss {summary['final_eval_loss']:.4f}" if summary.get("final_eval_loss") else ""
    print(
        f"done: {summary['final_step']} steps, final loss {summary['final_loss']:.4f}{eval_part}, "
        f"{summary['tokens_seen']:,} {summary.get('unit', 'tokens')} in {summary['wall_time_s']:.1f} s\n"
        f"results: {rundir.root}/ (summary.json, metrics.jsonl, logs/)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
