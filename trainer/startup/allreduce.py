"""Start-up, the gradient all-reduce settled: comm.allreduce=auto's plan measured (or reused from the
checkpoint or comm.plan_from) and the hook registered, then the overlapped reduction checked against the
synchronous one."""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path

from rundir import RunDir
from rundir.allreduce_plan import choose, plan_table
from storage.files import write_json_atomic
from trainer.errors import UserError, first_line
from trainer.loop.parts import Parts
from trainer.parallel.autotune import measure, mismatches, setup_of
from trainer.parallel.comm import check_overlapped
from trainer.parallel.wrap import hook_up

log = logging.getLogger("trainer")


def settle_allreduce(parts: Parts, rundir: RunDir) -> None:
    """After the restore, which may hold the plan to reuse: the plan, then the overlapped reduction checked
    against the synchronous one on the plan's sizes."""
    plan_allreduce(parts, rundir)
    check_overlap(parts)


def plan_allreduce(parts: Parts, rundir: RunDir) -> None:
    """comm.allreduce=auto (collective): give DDP's hook its plan. A resumed run reuses the plan its checkpoint
    recorded (the same algorithms, so the same reduction order: bit-exact), unless it was measured for another
    topology or comm settings; then comm.plan_from's; else it is measured now, for the bucket sizes the throw-away
    step saw, and written into the run directory."""
    dispatch = parts.wrapped.dispatch
    if dispatch is None or dispatch.algorithm is not None:
        return
    groups, plan, source = parts.distributed.groups, parts.state.allreduce_plan, parts.cfg.comm.plan_from
    wanted = setup_of(groups)
    how, measured = "recorded in the checkpoint, reused", "measured"
    if plan is not None and (changed := mismatches(plan, wanted)):
        measured = f"measured again: the checkpoint's plan was for {'; '.join(changed)}"
        plan = None
    if plan is None and source:
        plan, how = _plan_from(source, wanted), f"from {source}"
    if plan is None:
        plan = measure(groups, dispatch.sizes, parts.distributed.device, one_network=parts.env.one_network)
        how = "one host, one network" if plan["one_network"] else measured
        if parts.env.rank == 0:
            write_json_atomic(rundir.allreduce_plan, plan)
    parts.state.allreduce_plan = plan
    dispatch.plan = functools.partial(choose, plan)
    if groups.compress or any(row["choice"] != "flat" for row in plan["sizes"]):
        hook_up(parts.cfg, parts.distributed, parts.wrapped.module, dispatch)
        runs = "the trainer's hook runs it"
    else:
        # Every bucket flat: DDP's own all-reduce runs, with no hook (the same bits as comm.allreduce=flat). A
        # Python hook issuing the same all-reduce is slower: each bucket's call and completion take the GIL, which
        # DDP's C++ path never does (docs/measurements/notes-trainer.md).
        parts.wrapped.dispatch = None
        runs = "every bucket flat: DDP's own all-reduce runs, no hook"
    if parts.env.rank == 0:
        figures = f"measured in {plan['measured_s']:.2f} s, {plan['timing']}" if plan["measured_s"] else plan["timing"]
        log.info(
            "all-reduce plan (comm.allreduce=auto, %s; %s; %s):\n%s", how, figures, runs, "\n".join(plan_table(plan))
        )


def _plan_from(source: str, wanted: dict) -> dict:
    path = Path(source)
    path = path / RunDir(path).allreduce_plan.name if path.is_dir() else path
    try:
        plan = json.loads(path.read_text())
        mismatch = mismatches(plan, wanted)
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise UserError(
            f"comm.plan_from: cannot read an all-reduce plan from {path} ({first_line(exc)}); name the run directory "
            "of a run with comm.allreduce=auto (its allreduce_plan.json), or unset comm.plan_from to measure."
        ) from None
    if mismatch:
        raise UserError(
            f"comm.plan_from: the plan in {path} was measured for another set-up: {'; '.join(mismatch)}. Unset "
            "comm.plan_from to measure one for this run."
        )
    return plan


def check_overlap(parts: Parts) -> None:
    """comm.overlap (collective): before training, the overlapped reduction (the reducer's thread on CPU, a CUDA
    side stream on GPUs) must give the synchronous reduction's bits on every bucket size the hook will see; if it
    does not on some rank, training would go on with wrong gradients, so the run ends with the ranks named and
    the setting that avoids it. Not where DDP's own all-reduce runs (flat, or a plan that sends every bucket flat)."""
    dispatch = parts.wrapped.dispatch
    if dispatch is None or dispatch.overlapped is None:
        return
    sizes = dispatch.sizes
    start = time.perf_counter()
    bad = check_overlapped(dispatch, sizes, parts.distributed.device)
    where = "a CUDA side stream" if parts.distributed.device.type == "cuda" else "the reducer's thread"
    checked = ", ".join(f"{dispatch.choose(size)} {size / 1024:.1f} KiB" for size in sizes)
    if bad:
        raise UserError(
            f"comm.overlap: on rank(s) {', '.join(map(str, bad))} the gradient reduction overlapped with backward "
            f"(on {where}) gave other values than the same reduction run synchronously ({checked}): training with "
            "it would use wrong gradients. Set comm.overlap=false (each bucket is then reduced inside DDP's hook, "
            "blocking backward) and report this with the torch and NCCL versions.",
            collective=True,
        )
    if parts.env.rank == 0:
        log.info(
            "comm.overlap: the reduction on %s gave the synchronous one's bits (%s; checked in %.3f s)",
            where,
            checked,
            time.perf_counter() - start,
        )
