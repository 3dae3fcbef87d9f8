"""A launch's outcome comes from what that launch recorded in the run directory, not from the launcher's status."""

from hpc.policy.outcome import Ended, how_it_ended, launch_outcome, new_launch_id
from rundir import RunDir
from rundir.contract import EVENT_DONE, EVENT_START, EVENT_STOPPED, EXIT_DONE, EXIT_STOPPED, append_event
from tests.unit.test_checkpoint_layout import make_generation


def record(rundir, event, **fields):
    append_event(rundir.history, event, **fields)


def test_a_stop_counts_only_with_its_checkpoint_committed(tmp_path):
    rundir = RunDir(tmp_path)
    launch = new_launch_id("slurm-7.0")
    assert launch_outcome(rundir, launch) is None  # no history at all
    record(rundir, event=EVENT_START, step=0, launch=launch)
    make_generation(rundir.checkpoints, 10)
    record(rundir, event=EVENT_STOPPED, step=12, launch=launch)
    assert launch_outcome(rundir, launch) is None  # step 12 is not committed: not resumable from there
    make_generation(rundir.checkpoints, 12)
    assert launch_outcome(rundir, launch) == "stopped"
    assert launch_outcome(rundir, new_launch_id("slurm-7.1")) is None  # another launch recorded nothing


def test_done_needs_the_summary_and_ignores_other_launches_and_torn_lines(tmp_path):
    rundir = RunDir(tmp_path)
    earlier, launch = new_launch_id(), new_launch_id()
    assert earlier != launch
    record(rundir, event=EVENT_DONE, step=60, launch=earlier)
    rundir.summary.write_text("{}")
    with open(rundir.history, "a") as f:
        f.write('{"event": "do')  # cut short by a kill
        f.write("\n")
    assert launch_outcome(rundir, launch) is None
    record(rundir, event=EVENT_DONE, step=60, launch=launch)
    assert launch_outcome(rundir, launch) == "done"
    rundir.summary.unlink()
    assert launch_outcome(rundir, launch) is None


def test_what_a_launch_recorded_overrides_the_launchers_status(tmp_path):
    rundir = RunDir(tmp_path)
    launch = new_launch_id("slurm-9.0")
    assert how_it_ended(rundir, launch, EXIT_DONE).how == "done"  # nothing recorded: the status decides
    assert how_it_ended(rundir, launch, EXIT_STOPPED).how == "stopped"
    assert how_it_ended(rundir, launch, 137) == Ended("failed", 137)
    record(rundir, event=EVENT_STOPPED, step=10, signal=15, launch=launch)
    make_generation(rundir.checkpoints, 10)
    # srun said 137 (a slow rank killed in teardown by --kill-on-bad-exit), but the stop was committed
    assert how_it_ended(rundir, launch, 137) == Ended("stopped", 137, signal=15, recorded=True)
