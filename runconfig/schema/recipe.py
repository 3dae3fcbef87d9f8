"""What the top-level ``recipe`` key may name."""

from __future__ import annotations

import re

#: The built-in recipe's name; any other recipe is "module.path:function".
BUILTIN_RECIPE = "gpt"
RECIPE_RE = re.compile(r"^(gpt|[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*)$")
