"""Command-line options several login-node commands share, declared once."""

from __future__ import annotations

import argparse


def add_set_option(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``: a config key by dotted path, the value as YAML."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key by dotted path, e.g. --set train.steps=40 (repeatable)",
    )


def set_arguments(overrides: list[str]) -> list[str]:
    """``overrides`` as the ``--set`` arguments of another command line."""
    return [word for item in overrides for word in ("--set", item)]
