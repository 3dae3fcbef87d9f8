"""Config fields: each declared with its documentation and, where it has one, a simple rule (a range, a set of
choices, non-empty), which one generic function checks. Rules that relate several fields are each section's own
``relations()``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

Problems = list[tuple[str, str]]  # (key, what is wrong)


@dataclass(frozen=True)
class Range:
    """Bounds of a number; ``text`` says them in the error message and the reference when the plain form
    (``>= 1``, ``> 0``, ``in [0, 1)``) needs a word more, e.g. ``">= 0 (0: whole buckets)"``."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    text: str | None = None

    def holds(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def describe(self) -> str:
        if self.text:
            return self.text
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None
        high = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f">= {low[1:]}" if low[0] == "[" else f"> {low[1:]}"
        return f"<= {high[:-1]}" if high[-1] == "]" else f"< {high[:-1]}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def doc(
    text: str,
    default: Any = None,
    factory: Any = None,
    *,
    bounds: Range | None = None,
    choices: tuple[str, ...] | None = None,
    nonempty: str | None = None,
):
    """A dataclass field with its documentation and its simple rule: ``bounds`` (numbers), ``choices`` (strings
    that are not a Literal), ``nonempty`` (the message for an empty string or list)."""
    metadata = {"doc": text, "bounds": bounds, "choices": choices, "nonempty": nonempty}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def field_problems(section: Any) -> Problems:
    """Every field of ``section`` that breaks its declared rule, in declaration order."""
    out: Problems = []
    for f in dataclasses.fields(section):
        value, meta = getattr(section, f.name), f.metadata
        if value is None:
            continue
        bounds, choices, nonempty = meta.get("bounds"), meta.get("choices"), meta.get("nonempty")
        if bounds is not None and not bounds.holds(value):
            out.append((f.name, f"must be {bounds.describe()}, got {value}"))
        if choices is not None and value not in choices:
            options = (
                " or ".join(map(repr, choices)) if len(choices) == 2 else f"one of {', '.join(map(repr, choices))}"
            )
            out.append((f.name, f"must be {options}, got {value!r}"))
        if nonempty is not None and not value:
            out.append((f.name, nonempty))
    return out


def rule_text(f: dataclasses.Field) -> str:
    """The declared rule of a field in words, for the reference ("" when it has none)."""
    meta = f.metadata
    if meta.get("bounds") is not None:
        return meta["bounds"].describe()
    if meta.get("choices") is not None:
        return " or ".join(f"`{c}`" for c in meta["choices"])
    if meta.get("nonempty") is not None:
        return "not empty"
    return ""


class Section:
    """A config section: its problems are the fields' declared rules, then its own ``relations()``."""

    def relations(self) -> Problems:
        return []

    def check(self) -> Problems:
        return field_problems(self) + self.relations()
