"""A recipe module whose import fails (a dependency the user forgot to install)."""

import not_a_module_anywhere  # noqa: F401


def recipe(ctx):
    raise AssertionError("never reached")
