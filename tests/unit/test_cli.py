"""``python -m hpc --help`` says in one line what every verb does; ``--set`` means the same everywhere."""

import os
import re
import subprocess
import sys

from hpc.cli import HELP, parser
from tests.conftest import ROOT, run_cli


def test_every_verb_is_listed_with_its_line():
    proc = run_cli(["-m", "hpc", "--help"])
    assert proc.returncode == 0, proc.stderr
    text = re.sub(r"\s+", " ", proc.stdout)
    for verb, line in HELP.items():
        assert f" {verb} {line}" in text, (verb, proc.stdout)
    choices = next(a for a in parser()._actions if a.dest == "verb").choices
    assert set(choices) == set(HELP)


def test_set_is_one_option_with_one_help():
    commands = (["hpc.submit"], ["hpc", "resume"], ["hpc", "selftest"], ["hpc", "sweep"], ["hpc", "sbatch-args"])
    for words in commands:
        args = ["-m", *words, "--help"]
        proc = run_cli(args)
        assert proc.returncode == 0, proc.stderr
        assert "--set KEY=VALUE" in proc.stdout and "override a config key by dotted path" in proc.stdout, args


def test_sbatch_args_reach_sbatch_as_written_through_a_command_substitution():
    """`sbatch $(python -m hpc sbatch-args CONFIG)`: $(...) splits words but removes no quotes, so a constraint
    such as ib&a100 must come out bare (it once kept literal quotes, which sbatch took as part of the name)."""
    script = 'printf "%s\\n" $("$0" -m hpc sbatch-args tiny --set "job.constraint=ib&a100" --set job.partition=gpu)'
    proc = subprocess.run(["bash", "-c", script, sys.executable], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.splitlines()
    assert "--constraint=ib&a100" in words and "--partition=gpu" in words, words
