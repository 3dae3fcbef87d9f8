"""``python -m hpc --help`` says in one line what every verb does; ``--set`` means the same everywhere."""

import re

from hpc.cli import HELP, parser
from tests.conftest import run_cli


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
