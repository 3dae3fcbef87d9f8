"""The all-reduce plan of comm.allreduce=auto as data: the choice per bucket size and the table that the trainer's
log and `hpc report` print (the measurement itself runs on real process groups in tests/mp/test_allreduce.py)."""

import pytest

from runconfig import load_config
from runconfig.load import ConfigError
from rundir.allreduce_plan import choose, plan_table

PLAN = {
    "topology": [2, 2],
    "algorithms": ["flat", "hierarchical", "leader", "two_level"],
    "sizes": [
        {"bytes": 4096, "seconds": {"flat": 0.005, "hierarchical": 0.008, "leader": 0.004, "two_level": 0.006},
         "choice": "leader"},
        {"bytes": 1 << 20, "seconds": {"flat": 0.066, "hierarchical": 0.045, "leader": 0.046, "two_level": 0.09},
         "choice": "hierarchical"},
        {"bytes": 16 << 20, "seconds": {"flat": 1.07, "hierarchical": 0.75, "leader": 0.73, "two_level": 1.45},
         "choice": "leader"},
    ],
    "measured_s": 0.4,
    "timing": "median",
}  # fmt: skip


@pytest.mark.parametrize(
    "nbytes,expected",
    [(1, "leader"), (4096, "leader"), (60_000, "leader"), (70_000, "hierarchical"), (25 << 20, "leader")],
)
def test_choice_is_the_nearest_measured_size_on_a_log_scale(nbytes, expected):
    # 4 KiB and 1 MiB: the geometric midpoint is 64 KiB
    assert choose(PLAN, nbytes) == expected


def test_no_bucket_measured_is_flat():
    assert choose({**PLAN, "sizes": []}, 1 << 20) == "flat"


def test_table_has_every_algorithm_and_the_gain_over_flat():
    lines = plan_table(PLAN)
    assert lines[0] == "| bucket | flat ms | hierarchical ms | leader ms | two_level ms | chosen | vs flat |"
    assert lines[2] == "| 4.0 KiB | 5.00 | 8.00 | 4.00 | 6.00 | leader | 1.25x |"
    assert lines[3].startswith("| 1.0 MiB | 66.00 | 45.00 |") and lines[3].endswith("| hierarchical | 1.47x |")
    assert lines[4] == "| 16.0 MiB | 1070.00 | 750.00 | 730.00 | 1450.00 | leader | 1.47x |"
    assert plan_table({**PLAN, "sizes": [{"bytes": 512, "seconds": {}, "choice": "flat"}]})[2] == (
        "| 512 B | - | - | - | - | flat | - |"
    )


def test_plan_from_needs_auto():
    with pytest.raises(ConfigError, match="comm.plan_from"):
        load_config("tiny", ["comm.allreduce=flat", "comm.plan_from=/some/run"])


def test_a_plan_is_valid_only_for_the_set_up_it_was_measured_in():
    """Topology, comm.compress and comm.chunk_kb all change what each algorithm costs: a recorded plan that differs
    in any (or lacks one: written before it was recorded) is measured again, and comm.plan_from refuses it."""
    from trainer.parallel.autotune import mismatches, setup_of
    from trainer.parallel.comm import HierGroups

    wanted = setup_of(HierGroups(intra=None, inter=None, ranks_per_node=2, num_nodes=2, chunk_bytes=1 << 20))
    recorded = {**PLAN, "compress": False, "chunk_bytes": 1 << 20}
    assert mismatches(recorded, wanted) == []
    assert mismatches({**recorded, "compress": True}, wanted) == ["compress True (this run: False)"]
    assert mismatches({**recorded, "topology": [1, 4]}, wanted) == ["topology [1, 4] (this run: [2, 2])"]
    assert mismatches(PLAN, wanted) == ["compress None (this run: False)", "chunk_bytes None (this run: 1048576)"]


def test_auto_uses_another_algorithm_only_where_it_beats_flat_clearly():
    """trainer.parallel.autotune.choose_algorithm: the fastest by median, unless it is within the margin of flat or
    lost to flat in any round (a noisy start-up): then flat."""
    from trainer.parallel.autotune import MARGIN, choose_algorithm

    assert choose_algorithm({"flat": [1.0, 1.0, 1.0], "leader": [0.7, 0.6, 0.8]}) == "leader"
    assert choose_algorithm({"flat": [1.0, 1.0, 1.0], "leader": [0.5, 0.5, 1.1]}) == "flat"  # lost one round
    near = 1 / (1 + MARGIN / 2)
    assert choose_algorithm({"flat": [1.0, 1.0], "leader": [near, near]}) == "flat"  # inside the margin
    assert choose_algorithm({"flat": [1.0, 1.0], "leader": [2.0, 2.0], "pipelined": [0.6, 0.7]}) == "pipelined"
    assert choose_algorithm({"flat": [1.0], "two_level": [1.0]}) == "flat"  # a tie
