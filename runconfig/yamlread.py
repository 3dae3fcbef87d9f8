"""Reading YAML the way a config's author means it: a key twice in one mapping is an error, ``25:00`` is text, and
aliases may not expand a short file into a huge document.

PyYAML's ``safe_load`` silently keeps the last of two equal keys (``steps: 3`` then ``steps: 300``), and it reads
YAML 1.1's base-60 numbers: ``time: 25:00`` becomes the integer 1500, a 25-hour limit where Slurm would read 25
minutes. This loader refuses the first and leaves the second as the string the author wrote (the schema then reads
Slurm time limits as Slurm does). Aliases are shared references once loaded, but everything downstream (validation,
``dataclasses.asdict``, the resolved config written out) copies them: a "billion laughs" file of nine lines would
expand to 10^8 values, so a document whose aliases expand beyond ``MAX_EXPANDED_NODES`` is refused.
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


#: Values (scalars, lists, mappings) a document may hold once its aliases are expanded: far above any config's.
MAX_EXPANDED_NODES = 100_000


class AliasBombError(yaml.YAMLError):
    """A document whose aliases expand beyond MAX_EXPANDED_NODES values (or into themselves)."""

    def __init__(self, recursive: bool) -> None:
        what = "refer to themselves" if recursive else f"expand to more than {MAX_EXPANDED_NODES:,} values"
        super().__init__(f"its aliases (*name) {what}")
        self.recursive = recursive


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


def expanded_size(root: yaml.Node | None) -> int:
    """Values in the document under ``root`` with every alias expanded, counted without expanding anything (each
    node's count once); raises AliasBombError where aliases make it exceed MAX_EXPANDED_NODES, or on an alias
    inside its own anchor. A document as large without aliases is only large: it is read."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise AliasBombError(recursive=True)
        open_nodes.add(key)
        if isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        else:
            total = 1
        open_nodes.discard(key)
        if total > MAX_EXPANDED_NODES and total > len(sizes) + 1:  # more than its distinct nodes: aliases repeat
            raise AliasBombError(recursive=False)
        sizes[key] = total
        return total

    return 0 if root is None else size(root)


def load(text: str) -> Any:
    """Parse one YAML document with ``StrictLoader``; raises DuplicateKeyError, AliasBombError or YAMLError."""
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        expanded_size(node)
        return None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()
