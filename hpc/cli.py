"""``python -m hpc VERB``: one line of help per verb, then the verb (hpc/verbs.py, status.py, sweep_submit.py, runs.py,
compare.py, report.py, selftest.py, ui.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpc import verbs
from hpc.options import add_set_option
from hpc.status import VerbError, open_run, print_status, status
from hpc.sweep_submit import submit_sweep
from runconfig import ConfigError
from rundir.contract import EXIT_USER_ERROR

#: Each verb's one line, as ``python -m hpc --help`` lists them.
HELP = {
    "status": "a run's state, restarts, last checkpoint, progress, diagnosis",
    "pause": "stop at a step boundary with a checkpoint, then hold the job",
    "release": "let a paused run continue",
    "cancel": "cancel the run's unfinished Slurm jobs",
    "resume": "resubmit a stopped, failed or cancelled run from its checkpoint",
    "unexclude": "take a bad node of a run back: its next launch may use the node again",
    "logs": "print or follow a rank's log (or every rank's)",
    "sweep": "submit a grid or a random search of configs as one job array, pruning poor elements",
    "report": "plots and report.md: loss, speed, step time, goodput and its split, cost",
    "runs": "the runs under some folders, a row each: state, loss, speed, goodput, cost",
    "compare": "runs side by side: their rows, the config keys that differ, the loss curves in one PNG",
    "ui": "the MLflow UI over the runs' store, behind a private token (needs the ui extra)",
    "sbatch-args": "the job section as options for sbatch/*.sbatch",
    "selftest": "does the stop signal reach every rank in time?",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpc", description="The lifecycle of a run directory, on a login node.")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=HELP[name], description=kwargs.pop("description", HELP[name]), **kwargs)

    for name in ("status", "pause", "release", "cancel", "resume", "logs"):
        sp = verb(name)
        sp.add_argument("run_dir")
        if name == "status":
            sp.add_argument("--json", action="store_true", help="print the status as JSON")
        if name == "resume":
            add_set_option(sp)
            sp.add_argument(
                "--refresh-code",
                action="store_true",
                help="copy the recipe's code again (RUN_DIR/code/) instead of running the code of the first submit",
            )
        if name == "logs":
            sp.add_argument("--rank", type=int, default=0)
            sp.add_argument("--all", action="store_true", help="every rank's log")
            sp.add_argument("--follow", "-f", action="store_true", help="keep printing new lines")
    sp = verb("unexclude")
    sp.add_argument("run_dir")
    sp.add_argument("nodes", nargs="+", metavar="NODE", help="bad node(s) of the run (python -m hpc status RUN)")
    sp = verb("sweep")
    sp.add_argument("config", help="base config file or example name")
    sp.add_argument("grid", type=Path, help="YAML sweep file: grid: {KEY: [VALUES]} or random: {n: N, KEY: ...}")
    sp.add_argument("--run-dir", type=Path, help="sweep directory (default runs/sweep-NAME-YYYYmmdd-HHMMSS)")
    add_set_option(sp)
    sp.add_argument("--local", action="store_true", help="run the elements one after the other on this machine")
    sp.add_argument("--parallel", type=int, default=None, help="at most N elements at once (the job array's %%N)")
    sp = verb("runs", description="The runs under some folders (default runs/), one row each (hpc/runs.py)")
    sp.add_argument("folders", nargs="*", help="run directories, or folders holding them (a runs folder, a sweep)")
    sp.add_argument("--sort", help="a column to sort by, ascending (e.g. --sort eval_loss; --sort=-goodput descends)")
    sp.add_argument("--desc", action="store_true", help="sort descending")
    sp.add_argument("--filter", action="append", default=[], help="KEY<OP>VALUE, e.g. 'state=completed', 'loss<2.5'")
    sp.add_argument("--json", action="store_true", help="print the rows as JSON")
    sp = verb("compare")
    sp.add_argument("run_dirs", nargs="+", help="two or more run directories")
    sp.add_argument("--out", help="the PNG of the loss curves (default compare.png)")
    sp = verb("report", description="PNG plots and report.md with goodput, restarts, stragglers and cost")
    sp.add_argument("run_dir")
    sp.add_argument("--out", help="output folder (default RUN_DIR/report/)")
    sp = verb("ui")
    sp.add_argument("path", nargs="?", default="runs", help="runs folder (default runs/), run directory or store file")
    sp.add_argument("--port", type=int, default=0, help="the port on --host (default: a free one)")
    sp.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    verb("selftest", description=f"{HELP['selftest']} (python -m hpc selftest --help)", add_help=False)
    sp = verb(
        "sbatch-args",
        description="The config's job section as sbatch options, for sbatch/*.sbatch: "
        "sbatch $(python -m hpc sbatch-args CONFIG) sbatch/train.sbatch",
    )
    sp.add_argument("config", help="config file, example name or run directory (its bad nodes are excluded)")
    add_set_option(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["selftest"]:  # its own options (hpc/selftest.py)
        from hpc.selftest import main as selftest_main

        return selftest_main(argv[1:])
    args = parser().parse_args(argv)
    try:
        return run_verb(args)
    except (VerbError, ConfigError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


def run_verb(args: argparse.Namespace) -> int:
    if args.verb == "sweep":
        return submit_sweep(args)
    if args.verb == "sbatch-args":
        print(" ".join(verbs.sbatch_args(args.config, args.overrides)))
        return 0
    if args.verb == "runs":
        from hpc.runs import main as runs_main

        sort = f"-{args.sort.lstrip('-')}" if args.sort and args.desc else args.sort
        return runs_main(args.folders, sort=sort, filters=args.filter, as_json=args.json)
    if args.verb == "compare":
        from hpc.compare import main as compare_main

        return compare_main(args.run_dirs, out=args.out)
    if args.verb == "report":
        from hpc.report import main as report_main

        return report_main(args.run_dir, args.out)
    if args.verb == "ui":
        from hpc.ui import main as ui_main

        return ui_main(args.path, host=args.host, port=args.port)
    rundir = open_run(args.run_dir)
    if args.verb == "resume":
        return verbs.resume(rundir, args.overrides, refresh_code=args.refresh_code)
    if args.verb == "unexclude":
        verbs.unexclude(rundir, args.nodes)
        return 0
    if args.verb == "status":
        info = status(rundir)
        print(json.dumps(info, indent=2)) if args.json else print_status(info)
    elif args.verb == "logs":
        verbs.logs(rundir, rank=args.rank, all_ranks=args.all, follow=args.follow)
    else:
        {"cancel": verbs.cancel, "pause": verbs.pause, "release": verbs.release}[args.verb](rundir)
    return 0
