"""The trainer's start-up imports run with the cyclic garbage collector off (trainer/main.py); once they are done it
is on again, the imported objects frozen out of its sight. That it is on during training is checked by every launch
of the toy project (tests/mp/projects/toyproj/recipes.py)."""

import os
import subprocess

from tests.conftest import PY, ROOT


def test_importing_the_entry_point_turns_the_collector_off_and_start_up_turns_it_on_frozen():
    code = (
        "import gc\n"
        "assert gc.isenabled()\n"
        "import trainer.main as m\n"
        "off = not gc.isenabled()\n"
        "m._collector_back_on()\n"
        "print(off, gc.isenabled(), gc.get_freeze_count())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    off, on, frozen = proc.stdout.split()
    assert off == "True" and on == "True" and int(frozen) > 1000, proc.stdout
