"""Reading YAML the way a config's author means it: a key twice in one mapping is an error, and ``25:00`` is text.

PyYAML's ``safe_load`` silently keeps the last of two equal keys (``steps: 3`` then ``steps: 300``), and it reads
YAML 1.1's base-60 numbers: ``time: 25:00`` becomes the integer 1500, a 25-hour limit where Slurm would read 25
minutes. This loader refuses the first and leaves the second as the string the author wrote (the schema then reads
Slurm time limits as Slurm does).
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping (line numbers from 1)."""

    def __init__(self, key: Any, first_line: int, second_line: int) -> None:
        super().__init__(f"key {key!r} appears twice in one mapping, at lines {first_line} and {second_line}")
        self.key, self.first_line, self.second_line = key, first_line, second_line


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without duplicate keys and without base-60 numbers."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first != key_node.start_mark.line + 1:
                    raise DuplicateKeyError(key, first, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep=deep)


# The implicit int and float resolvers of yaml.SafeLoader, less their base-60 forms (``1:30``, ``1:30.5``).
_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NUMBERS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
StrictLoader.add_implicit_resolver(
    _NUMBERS[0],
    re.compile(
        r"""^(?:[-+]?0b[0-1_]+
        |[-+]?0[0-7_]+
        |[-+]?(?:0|[1-9][0-9_]*)
        |[-+]?0x[0-9a-fA-F_]+)$""",
        re.X,
    ),
    list("-+0123456789"),
)
StrictLoader.add_implicit_resolver(
    _NUMBERS[1],
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
        |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load(text: str) -> Any:
    """Parse one YAML document with ``StrictLoader``."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)
