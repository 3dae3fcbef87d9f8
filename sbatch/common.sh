# shellcheck shell=bash
# Shared logic of sbatch/train.sbatch and sbatch/resume.sbatch: sourced by them, never run on its own.
#
# It does in the batch shell what hpc/driver.py does for jobs submitted by `python -m hpc.submit`: read (or, for
# train.sbatch, first create) RUN_DIR/config.yaml, start the ranks as one step
#   srun --mpi=PLUGIN --kill-on-bad-exit=1 PYTHON -u -m trainer --run-dir RUN_DIR
# and then do what hpc/policy/decide.py says (python -m hpc.policy.decide): finish (status 0), restart the ranks in
# this job (a failure that is not the input's, up to job.max_failures per run), requeue the job (status 75: the
# trainer stopped on a signal at a step boundary and committed a checkpoint), or give up with the status it gives.
# A new run (train.sbatch) also gets the recipe's code snapshot in RUN_DIR/code/ (rundir/snapshot.py), taken from
# the CONFIG file's folder, its parent or the submit directory; every launch, requeues included, imports that copy.
#
# Environment (read by hpc_main; see sbatch/README.md):
#   RUN_DIR           run directory (required); relative paths are taken from the submit directory
#   CONFIG            train.sbatch only: config file or built-in example name used when RUN_DIR has no config.yaml
#   HPC_SET           KEY=VALUE overrides separated by spaces (shell-style quoting allowed), e.g.
#                     HPC_SET="train.steps=40 model.d_model=64"; train.sbatch applies them when it creates the
#                     config, resume.sbatch to the existing config (like `python -m hpc.submit --resume --set`)
#   PYTHON            interpreter with the project's packages (default: python on PATH)
#   HPC_MPI           srun --mpi plugin (default: job.mpi; auto = pmi2 for the mpich wheel, pmix for Open MPI)
#   HPC_MAX_REQUEUES  requeues after a stop before giving up (default: the config's job.max_requeues, 20)
#   HPC_SETUP         a file sourced before anything else (module loads, e.g. envs/modules.sh)
#   HPC_REPO          the checkout holding sbatch/common.sh (found by the .sbatch scripts, see there)

hpc_die() {  # hpc_die STATUS MESSAGE...: one clear line in the job's output, then exit
  local status=$1
  shift
  echo "error: $*" >&2
  exit "$status"
}

# The torch-free part, in Python: validate (and create or update) the run directory's config and print the facts
# the shell needs as shell assignments, every value quoted with shlex.quote (so `eval` expands nothing).
# Arguments: MODE (train|resume) RUN_DIR. Environment: CONFIG, HPC_SET, SLURM_JOB_NUM_NODES, SLURM_NTASKS(_PER_NODE).
# Exit status 2 with one line on stderr for any user error.
hpc_prepare() {
  "$PYTHON" - "$@" <<'PY'
import json
import os
import shlex
import sys
from pathlib import Path

from runconfig import ConfigError, dump_yaml, load_config
from rundir import RunDir
from hpc.policy.badnodes import bad_nodes, take_back_due
from rundir.snapshot import search_path, take
from rundir.contract import EVENT_CODE, EXIT_STOPPED, append_event
from rundir.slurmvars import slurm_queue_id
from hpc import runlock

mode, root = sys.argv[1], Path(sys.argv[2])
rundir = RunDir(root)
overrides = shlex.split(os.environ.get("HPC_SET", ""))


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def no_spares(cfg, where):
    if cfg.job.spare_ranks:
        fail(f"{where}: job.spare_ranks={cfg.job.spare_ranks}: the plain sbatch scripts keep no warm spares (their "
             "ranks are MPI processes, ended together); submit with python -m hpc.submit, or set job.spare_ranks: 0.")


def write_config(cfg):  # atomically: a job killed half-way leaves the old file or none, never a partial one
    tmp = rundir.config.with_name(f".config.yaml.tmp-{os.getpid()}")
    tmp.write_text(dump_yaml(cfg))
    os.replace(tmp, rundir.config)


def allocation_shape():  # --nodes / --ntasks-per-node of this job, as job.* overrides
    nodes = os.environ.get("SLURM_JOB_NUM_NODES", "")
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
    tasks = os.environ.get("SLURM_NTASKS", "")
    if not per_node.isdigit() and nodes.isdigit() and tasks.isdigit() and int(tasks) % int(nodes) == 0:
        per_node = str(int(tasks) // int(nodes))
    shape = [f"job.nodes={nodes}"] if nodes.isdigit() else []
    return shape + ([f"job.ranks_per_node={per_node}"] if per_node.isdigit() else [])




def hold_run():  # this job trains the run: refused while another launch does (hpc/runlock.py)
    job_id = slurm_queue_id(os.environ)
    if job_id:
        try:
            runlock.join(rundir, job_id)
        except runlock.RunLocked as exc:
            fail(exc)


# Before anything is read from it: a RUN_DIR that someone else made or can write is refused (rundir/paths.py).
problem = rundir.owner_error()
if problem:
    fail(problem)
if rundir.config.is_file():
    hold_run()
try:
    if rundir.config.is_file():
        if mode == "train" and (os.environ.get("CONFIG") or overrides):
            print(f"{rundir.config} exists: resuming this run (CONFIG and HPC_SET apply only to a new run)")
            overrides = []
        cfg = load_config(str(rundir.config), overrides)
        no_spares(cfg, rundir.config)
        if overrides:
            write_config(cfg)
            print(f"updated {rundir.config}: {' '.join(overrides)}")
    elif mode == "resume":
        fail(f"{root} is not a run directory (it has no config.yaml); nothing to resume. Start a run with "
             "train.sbatch and CONFIG=..., or python -m hpc.submit.")
    elif not os.environ.get("CONFIG"):
        fail(f"{root} has no config.yaml: set CONFIG (a config file or a built-in example name such as tiny) "
             "to start a new run there.")
    else:
        # The allocation's shape first, so the config records the job that runs it; HPC_SET may still override.
        cfg = load_config(os.environ["CONFIG"], allocation_shape() + overrides)
        no_spares(cfg, os.environ["CONFIG"])
        # An existing folder is fine (it may hold this job's own --output file), but not another run's files.
        leftovers = [p.name for p in (rundir.metrics, rundir.history, rundir.summary, rundir.failure) if p.exists()]
        leftovers += [p.name for p in (rundir.checkpoints, rundir.logs) if p.is_dir() and any(p.iterdir())]
        if leftovers:
            fail(f"run directory {root} has no config.yaml but holds another run's files ({', '.join(leftovers)}); "
                 "choose another RUN_DIR.")
        rundir.create()
        problem = rundir.writable_error()
        if problem:
            fail(problem)
        hold_run()
        # The recipe's code before the config: config.yaml marks the run as made, and its code must be there then.
        config_file = Path(os.environ["CONFIG"])
        snap = take(rundir, cfg.recipe, search_path(config_file if config_file.is_file() else None))
        write_config(cfg)
        print(f"created run directory {root} from {os.environ['CONFIG']}")
        if snap is not None:
            print(f"code snapshot: {snap.module} {snap.sha256[:12]} ({snap.files} files)")
            append_event(rundir.history, EVENT_CODE, module=snap.module, sha256=snap.sha256, source=snap.source,
                         refreshed=False)
except ConfigError as exc:
    fail(exc)
except OSError as exc:
    fail(f"run directory {root}: {exc.strerror or exc} ({exc.filename or root})")

problem = rundir.writable_error()
if problem:
    fail(problem)
# The rules the driver of `python -m hpc.submit` jobs uses, imported rather than written again here.
from hpc.driver import memory_of, run_complete  # noqa: E402
from hpc.local import rank_variables  # noqa: E402
from hpc.slurm import requoted_setup  # noqa: E402
from hpc import slurmctl  # noqa: E402
from hpc.slurmctl import held_by_slurm  # noqa: E402

complete = run_complete(rundir, cfg)
job = cfg.job
env = rank_variables(cfg, dict(os.environ))
q = shlex.quote
print("#HPC-VARS")  # everything below is eval'ed by the batch script
print(f"hpc_exit_stopped={EXIT_STOPPED}")  # rundir/contract.py: stopped by a signal, checkpoint committed
print(f"hpc_complete={int(complete)}")
print(f"hpc_steps={cfg.train.steps}")
print(f"hpc_world_cfg={job.world_size}")
print(f"hpc_rpn={job.ranks_per_node}")
memory = memory_of(cfg, rundir)  # checkpoint.memory_every_steps: removed from every node once no launch follows
print(f"hpc_memory_args=({' '.join(q(a) for a in (['--memory-dir', memory[0], '--run-id', memory[1]] if memory else []))})")
# Bad nodes of the run (hpc/policy/badnodes.py) are left out of every launch: the allocation's other nodes, at least
# job.min_nodes of them; fewer, and the run continues in a new job that excludes them.
# Bad nodes due back (job.retake_nodes_after_s) are taken back first, unless Slurm still holds them down or drained.
take_back_due(rundir, job.retake_nodes_after_s, held_by_slurm)
bad = bad_nodes(rundir)
hostnames = list(slurmctl.hostnames(os.environ.get("SLURM_JOB_NODELIST", "")))
usable = [n for n in hostnames if n not in bad][: job.nodes]
print(f"hpc_alloc={q(','.join(hostnames))}")
print(f"hpc_use={q(','.join(usable) if len(usable) < len(hostnames) else '')}")
print(f"hpc_exclude={q(','.join(bad))}")
print(f"hpc_too_few={int(bool(hostnames) and len(usable) < job.min_nodes_or_all)}")
# job.mpi: auto resolves as the driver resolves it (hpc/driver.py mpi_plugin: the MPI library's flavour).
try:
    from hpc.driver import mpi_plugin

    plugin = mpi_plugin(cfg)
except Exception as exc:  # no mpirun beside this Python: say so, and fall back to the mpich wheel's plugin
    print(f"note: job.mpi={job.mpi} could not be resolved ({exc}); using pmi2", file=sys.stderr)  # not eval'd
    plugin = "pmi2"
print(f"hpc_mpi_cfg={q(plugin)}")
print(f"hpc_srun_args=({' '.join(q(a) for a in job.srun_args)})")
print(f"hpc_launch_prefix=({' '.join(q(a) for a in job.launch_prefix)})")
print(f"hpc_env=({' '.join(q(f'{k}={v}') for k, v in sorted(env.items()))})")
# job.setup lines re-quoted word by word, as hpc/slurm.py puts them in submitit's script: nothing is expanded.
print(f"hpc_setup=({' '.join(q(line) for line in requoted_setup(cfg))})")
PY
}

# hpc_resubmit EXCLUDE WHY: end this job; the run continues in a new job of the same batch script and shape that
# excludes the run's bad nodes (a running job's exclusions cannot be changed, and a requeue could land on them).
hpc_resubmit() {
  local exclude=$1 why=$2 new_id
  # hpc/slurmctl.py: the same script with this job's shape, limit and output; this job made non-requeueable first
  new_id=$("$PYTHON" -m hpc.slurmctl resubmit "$SLURM_JOB_ID" "$exclude") ||
    hpc_die 1 "$why; submitting the continuation with --exclude=$exclude failed (above). Resume by hand."
  "$PYTHON" -m hpc.runlock hand-over "$RUN_DIR" "$new_id"  # the run's lock: the continuation's, not a stranger's
  echo "$why; the run continues in job $new_id (--exclude=$exclude)"
  exit 0
}

# hpc_main MODE: the whole job. MODE is "train" (create RUN_DIR from CONFIG when needed) or "resume".
hpc_main() {
  local mode=$1 out status restarts line plugin
  # Set by eval'ing hpc_prepare's output:
  local hpc_exit_stopped="" hpc_complete=0 hpc_steps=0 hpc_world_cfg=0 hpc_mpi_cfg=auto hpc_rpn=1
  local hpc_alloc="" hpc_use="" hpc_exclude="" hpc_too_few=0
  local -a hpc_srun_args=() hpc_launch_prefix=() hpc_env=() hpc_setup=() hpc_memory_args=()
  # Files and folders the job writes are private, like the run directory (it may hold pickles and configs).
  umask 077
  # A stray USR1/USR2 to the batch shell (scancel --full, --signal=B:...) must not kill it: the ranks handle the
  # stop themselves. A trap (not `trap ''`) so that srun and the ranks do not inherit an ignored signal. It notes
  # the signal: a rank it killed before the rank's handler was in place ended the launch as a stop.
  local hpc_stop_seen=""
  trap 'hpc_stop_seen=1' USR1 USR2

  if [ -n "${HPC_SETUP:-}" ]; then
    [ -f "$HPC_SETUP" ] || hpc_die 2 "HPC_SETUP=$HPC_SETUP is not a file"
    # shellcheck source=/dev/null
    source "$HPC_SETUP"
  fi
  PYTHON=${PYTHON:-python}
  command -v "$PYTHON" > /dev/null || hpc_die 2 "PYTHON=$PYTHON not found; set PYTHON=/path/to/venv/bin/python"
  [ -n "${RUN_DIR:-}" ] || hpc_die 2 "set RUN_DIR, e.g. RUN_DIR=/shared/runs/tiny-1 sbatch ..."
  RUN_DIR=$(realpath -m -- "$RUN_DIR")
  # The checkout comes first on the import path (as hpc/local.py does), so no `pip install -e .` is needed.
  export PYTHONPATH="$HPC_REPO${PYTHONPATH:+:$PYTHONPATH}"
  # Nor is the submit folder on the ranks' import path (Python 3.11+): the recipe comes from the code snapshot.
  export PYTHONSAFEPATH=1

  out=$(hpc_prepare "$mode" "$RUN_DIR") || exit "$?"  # its error line went to stderr already
  printf '%s\n' "${out%%#HPC-VARS*}" | sed '/^$/d'
  eval "${out#*#HPC-VARS}"

  if [ "$hpc_complete" = 1 ]; then
    echo "run $RUN_DIR is already complete ($hpc_steps steps); job ${SLURM_JOB_ID:-} ends without work"
    exit 0
  fi
  if [ -n "${SLURM_NTASKS:-}" ] && [ "$SLURM_NTASKS" != "$hpc_world_cfg" ]; then
    echo "note: this job has $SLURM_NTASKS tasks, the config says $hpc_world_cfg (job.nodes x job.ranks_per_node);" \
      "the trainer uses the job's ($SLURM_NTASKS ranks)"
  fi
  for line in "${hpc_setup[@]}"; do
    eval "$line"  # re-quoted word by word in hpc_prepare: runs the command without expanding anything in it
  done

  plugin=${HPC_MPI:-}
  if [ -z "$plugin" ]; then
    plugin=$hpc_mpi_cfg  # job.mpi, with auto resolved by hpc_prepare as hpc/driver.py resolves it
  fi
  # --overlap: a step whose node was lost can stay RUNNING, holding its CPUs on the live nodes (hpc/driver.py)
  local command=(srun "--mpi=$plugin" --kill-on-bad-exit=1 --overlap "${hpc_srun_args[@]}"
    "${hpc_launch_prefix[@]}" "$PYTHON" -u -m trainer --run-dir "$RUN_DIR")
  restarts=${SLURM_RESTART_COUNT:-0}  # unset on the first run, not 0
  if [ "$hpc_too_few" = 1 ]; then
    hpc_resubmit "$hpc_exclude" "this job's allocation holds bad node(s) of the run ($hpc_exclude)"
  fi
  local attempt=0 suffix action exit_status delay message use_next first failed_nodes errfile nodes_now
  local -a placement=() shown=()
  local -a decide_args=(--requeues "$restarts")
  if [ -z "${HPC_MAX_REQUEUES:-}" ] && [ -n "${HPC_MAX_RESTARTS:-}" ]; then  # the old name
    echo "warning: HPC_MAX_RESTARTS is now HPC_MAX_REQUEUES (the old name is still read)" >&2
    HPC_MAX_REQUEUES=$HPC_MAX_RESTARTS
  fi
  [ -n "${HPC_MAX_REQUEUES:-}" ] && decide_args+=(--max-requeues "$HPC_MAX_REQUEUES")
  [ -n "${SLURM_JOB_ID:-}" ] || decide_args+=(--local)
  while :; do
    # rank 0 tags its history with the launch id
    suffix=""
    [ "$attempt" = 0 ] || suffix="-r$attempt"
    export HPC_LAUNCH_ID="sbatch-${SLURM_JOB_ID:-none}.$restarts-$$-$RANDOM$RANDOM$suffix"
    placement=()  # the allocation's nodes that are not bad, when some are
    if [ -n "$hpc_use" ]; then  # the job's SLURM_NTASKS would ask for every rank: the step's count is given too
      nodes_now=$(tr ',' '\n' <<< "$hpc_use" | wc -l)
      placement=("--nodes=$nodes_now" "--ntasks=$((nodes_now * hpc_rpn))" "--nodelist=$hpc_use")
    fi
    shown=("${command[0]}" "${placement[@]}" "${command[@]:1}")
    echo "job ${SLURM_JOB_ID:-?} (restart $restarts, launch $HPC_LAUNCH_ID): ${shown[*]}"
    rm -f -- "$RUN_DIR/failure.json" "$RUN_DIR"/.failure.json.tmp-*  # an earlier launch's diagnosis is not this one's
    hpc_stop_seen=""  # a signal before this launch is not what ends it
    # srun's stderr is copied through and kept: its first "task N: Killed/Exited" line names who failed first.
    errfile="$RUN_DIR/logs/srun-$HPC_LAUNCH_ID.err"
    { env "${hpc_env[@]}" "${command[0]}" "${placement[@]}" "${command[@]:1}" 2>&1 1>&3 3>&- |
      tee "$errfile" >&2 3>&-; } 3>&1
    status=${PIPESTATUS[0]}
    first=$(sed -nE 's/^srun: error: [^ ]+: tasks? ([0-9]+).*/\1/p' "$errfile" | head -n 1)
    failed_nodes=$(sed -nE 's/^srun: error: Node failure on ([^ ]+)$/\1/p' "$errfile" | paste -sd, -)
    rm -f -- "$errfile"
    # What to do now is one Python function for every launcher (hpc/policy/decide.py): done, restart the ranks in
    # this allocation (recorded in history.jsonl), requeue, or end. It reads how the launch ended from what it
    # recorded in the run directory (srun's status misreads a stop whose slower ranks --kill-on-bad-exit killed in
    # teardown, after the checkpoint was committed).
    { read -r action exit_status delay && IFS= read -r message && read -r use_next && read -r hpc_exclude; } < <(
      "$PYTHON" -m hpc.policy.decide "$RUN_DIR" "$HPC_LAUNCH_ID" "$status" "${decide_args[@]}" \
        --nodes "$hpc_alloc" --launch-nodes "${hpc_use:-$hpc_alloc}" --ranks-per-node "$hpc_rpn" \
        ${first:+--first-ended "$first"} ${failed_nodes:+--failed-nodes "$failed_nodes"} \
        ${hpc_stop_seen:+--stop-signal} ||
        printf 'end 1 0\nerror: deciding after the launch failed (exit status %s)\n-\n-\n' "$status")
    if [ "$action" != restart ] && [ -n "${SLURM_JOB_ID:-}" ]; then
      if { [ "$status" != 0 ] && [ "$status" != "$hpc_exit_stopped" ]; } || [ ${#hpc_memory_args[@]} -gt 0 ]; then
        # Ranks killed or dead in MPI_Init leave shared memory on their nodes: one task per node removes it (a
        # restarted launch does that itself, on each node, as it starts), and the run's checkpoints in node memory.
        srun --overlap --mpi=none --nodes="${SLURM_JOB_NUM_NODES:-1}" --ntasks="${SLURM_JOB_NUM_NODES:-1}" \
          --ntasks-per-node=1 "$PYTHON" -m hpc.shmsweep "${hpc_memory_args[@]}" ||
          echo "warning: the shared-memory sweep failed" >&2
      fi
    fi
    [ "$action" = restart ] || break
    echo "$message"
    hpc_use=""  # the restart's nodes when they are fewer than the allocation's
    [ "$use_next" = - ] || [ "$use_next" = "$hpc_alloc" ] || hpc_use=$use_next
    sleep "$delay"
    attempt=$((attempt + 1))
  done
  case $action in
    done)
      [ "$status" = 0 ] || echo "srun exit status $status, but this launch completed the run"
      echo "$message"
      exit 0 ;;
    resubmit)
      hpc_resubmit "$hpc_exclude" "$message" ;;
    requeue|requeuehold)
      echo "$message; scontrol $action $SLURM_JOB_ID"
      # Requeueing from inside the job ends it at once: everything is already committed.
      "$PYTHON" -m hpc.slurmctl "$action" "$SLURM_JOB_ID" ||
        hpc_die "$hpc_exit_stopped" "scontrol $action $SLURM_JOB_ID failed; resume by hand"
      exit 0 ;;
    *)
      if [ "${message#error: }" = "$message" ]; then echo "$message"; else echo "$message" >&2; fi
      exit "$exit_status" ;;
  esac
}
