"""``python -m hpc sweep``: a sweep's elements made and submitted as one Slurm job array, or run one after the
other on this machine (the sweep itself, its spec and results table: hpc/sweep.py)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from hpc import slurmctl
from hpc import sweep as sw
from hpc.driver import Driver
from hpc.slurm import make_executor
from hpc.status import VerbError
from hpc.submit import config_search, snapshot_new_run
from hpc.submit import main as submit_main
from hpc.sweeptrack import open_parent
from runconfig import load_config
from rundir import RunDir
from rundir.contract import EXIT_DONE, EXIT_STOPPED
from rundir.snapshot import locate


def submit_sweep(args: argparse.Namespace) -> int:
    """``python -m hpc sweep CONFIG SWEEP.yaml``: the elements' run directories and code snapshots, then one job
    array (or, without Slurm or with --local, the elements one after the other here); the exit status."""
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
    open_parent(sweep_dir, elements[0][1], spec.summary(), list(spec.points[0]))
    if args.local or not slurmctl.available():
        sw.record(sweep_dir, elements, dirs, [""] * len(dirs))
        statuses = []
        for d in dirs:
            statuses.append(submit_main(["--resume", str(d.root), "--local"]))
            table = sw.element_ended(d, "failed" if statuses[-1] not in (EXIT_DONE, EXIT_STOPPED) else None)
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
