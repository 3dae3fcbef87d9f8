"""What the driver reads from srun's stderr and the ranks' diagnosis to end a step whose lost node's tasks never
report (hpc/driver.py run_srun_step)."""

import json

from hpc.driver import SRUN_TASK_ERROR, suspect_ranks, task_numbers


def test_srun_task_lines_give_every_task_they_name():
    lines = {
        "srun: error: n2: task 3: Killed": {3},
        "srun: error: n1: tasks 0-1: Exited with exit code 3": {0, 1},
        "srun: error: n1: tasks 0,2-3: Terminated": {0, 2, 3},
    }
    for line, tasks in lines.items():
        m = SRUN_TASK_ERROR.match(line)
        assert m is not None and task_numbers(m.group(2)) == tasks, line
    assert SRUN_TASK_ERROR.match("srun: error: Node failure on n2") is None


def test_the_diagnosis_names_its_suspects(tmp_path):
    failure = tmp_path / "failure.json"
    assert suspect_ranks(failure) == set()  # not written yet
    failure.write_text(json.dumps({"message": "m", "suspects": [{"rank": 2, "node": "n2"}, {"rank": 3}]}))
    assert suspect_ranks(failure) == {2, 3}
    failure.write_text("{half")  # being written: nothing yet
    assert suspect_ranks(failure) == set()
