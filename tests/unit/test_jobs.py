"""What the run's verbs read from a job's scontrol state (hpc/slurmctl.py)."""

import pytest

from hpc.slurmctl import JobState


@pytest.mark.parametrize(
    ("state", "reason", "held"),
    [
        ("PENDING", "JobHeldUser", True),  # scontrol hold
        ("PENDING", "JobHeldAdmin", True),
        # a job that requeue-held itself (hpc/driver.py on pause), in the order the local cluster showed them:
        ("COMPLETING", "job_requeued_in_held_state", True),  # its processes still ending: release is taken
        ("PENDING", "job_requeued_in_held_state", True),
        ("REQUEUE_HOLD", "job_requeued_in_held_state", True),
        ("COMPLETING", "None", False),  # released while completing: not held any more
        ("PENDING", "BeginTime", False),
        ("PENDING", "Resources", False),
        ("RUNNING", "None", False),
        ("CANCELLED", "JobHeldUser", False),  # finished: nothing to release
        ("UNKNOWN", "held", False),
    ],
)
def test_held_is_any_unfinished_job_whose_reason_says_held(state, reason, held):
    assert JobState("7", state, reason).held is held
