"""YAML -> RunConfig, validated once, with one-paragraph errors naming the file and key."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import sys
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from runconfig import yamlread
from runconfig.schema import RunConfig
from runconfig.secrets import WHERE_CREDENTIALS_GO, find_secret, key_is_secret


class ConfigError(Exception):
    """A user error in a config file or override; the message is one paragraph, meant to be printed as is."""


def example_names() -> list[str]:
    """Names of the example configs shipped inside the package."""
    folder = resources.files("runconfig") / "examples"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def resolve_config_path(spec: str) -> Path:
    """A config given as a path, or the name of a shipped example (``tiny``)."""
    path = Path(spec)
    if path.is_file():
        return path
    if path.exists():
        raise ConfigError(f"config {spec!r} is not a file.")
    if "/" not in spec and spec in example_names():
        return Path(str(resources.files("runconfig") / "examples" / f"{spec}.yaml"))
    raise ConfigError(
        f"config file {spec!r} does not exist, and it is not the name of a built-in example "
        f"(built-in examples: {', '.join(example_names())})."
    )


def load_config(spec: str, overrides: list[str] = ()) -> RunConfig:
    """Load a config file (or example name), apply ``KEY=VALUE`` overrides, and validate it."""
    raw, path = load_raw(spec, overrides)
    return from_dict(raw, source=str(path))


def load_raw(spec: str, overrides: list[str] = ()) -> tuple[dict, Path]:
    """The config file as plain data with overrides applied, not yet validated (sweeps add keys to it)."""
    path = resolve_config_path(spec)
    try:
        raw = yamlread.load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        byte = f"0x{exc.object[exc.start]:02x}"
        raise ConfigError(
            f"config file {path} is not UTF-8 text: the byte at offset {exc.start} ({byte}) is not valid UTF-8 "
            f"({exc.reason}); save the config as UTF-8 (or check that it is the YAML file you meant)."
        ) from None
    except yamlread.DuplicateKeyError as exc:
        raise ConfigError(
            f"config file {path}: key {exc.key!r} appears twice in one mapping, at lines {exc.first_line} and "
            f"{exc.second_line}; keep one of them (YAML readers differ on which one wins, so neither is taken)."
        ) from None
    except yamlread.AliasBombError as exc:
        raise ConfigError(
            f"config file {path}: {exc}, which no config needs (a 'billion laughs' file would exhaust the memory of "
            "whoever loads it); write the values out, or use fewer nested aliases."
        ) from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{at}: {problem}.") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}.") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections, got {_kind(raw)}.")
    for item in overrides:
        apply_override(raw, item)
    return raw, path


def apply_override(raw: dict, item: str) -> None:
    """Apply one ``--set a.b=value`` override in place; the value is parsed as a YAML scalar or list."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like KEY=VALUE, e.g. train.steps=40.")
    try:
        value = yamlread.load(text)
    except yaml.YAMLError:
        value = text
    set_key(raw, key, value, what=f"override {item!r}")


def set_key(raw: dict, key: str, value: Any, *, what: str) -> None:
    """Set a dotted key in config data after checking that the schema has it."""
    if key in RENAMED:
        print(f"warning: {what}: key {key!r} is now {RENAMED[key]!r} (the old name is still read).", file=sys.stderr)
        key = RENAMED[key]
    parts = key.split(".")
    secret = find_secret({key: value})
    if secret or key_is_secret(parts[-1]):
        why = secret[1] if secret else "its name says it holds a credential"
        origin = what.split(" ", 1)[0]  # not ``what`` itself: it may quote the value
        raise ConfigError(f"{origin} of key {key!r}: key {key!r} is refused: {why}; {WHERE_CREDENTIALS_GO}.")
    _check_path(parts, what)
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{what}: {part!r} is not a section in the config file.")
    node[parts[-1]] = value


def _check_path(parts: list[str], what: str) -> None:
    cls: Any = RunConfig
    for depth, part in enumerate(parts):
        if typing.get_origin(cls) is dict:
            return  # a mapping (recipe_args, job.env): any key below it, its values checked when the config is built
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"{what}: {'.'.join(parts[:depth])} is a value, not a section.")
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            where = ".".join(parts[:depth]) or "top level"
            raise ConfigError(
                f"{what}: unknown key {'.'.join(parts[: depth + 1])!r} ({where} has: {', '.join(names)})."
            )
        cls = typing.get_type_hints(cls)[part]


#: keys that were renamed: old dotted key -> new one (the old one is still read, with a one-line warning)
RENAMED = {"job.max_restarts": "job.max_requeues"}


def _renamed_keys(raw: dict, source: str) -> None:
    """Move each renamed key of ``raw`` to its new name, saying so on stderr; both names at once is an error."""
    for old, new in RENAMED.items():
        (section, old_key), new_key = old.split("."), new.split(".")[1]
        node = raw.get(section)
        if not isinstance(node, dict) or old_key not in node:
            continue
        if new_key in node:
            raise ConfigError(f"config {source}: keys {old!r} and {new!r} are the same setting; keep {new!r}.")
        node[new_key] = node.pop(old_key)
        print(f"warning: config {source}: key {old!r} is now {new!r}; rename it (the old name is still read).",
              file=sys.stderr)  # fmt: skip


def from_dict(raw: dict, *, source: str = "<config>") -> RunConfig:
    """Build and validate a RunConfig from plain data (as loaded from YAML)."""
    _renamed_keys(raw, source)
    secret = find_secret(raw)
    if secret:
        raise ConfigError(f"config {source}: key {secret[0]!r} is refused: {secret[1]}; {WHERE_CREDENTIALS_GO}.")
    cfg = _build(RunConfig, raw, source, prefix="")
    problems = [(f"{section}.{key}", msg) for section in _sections() for key, msg in getattr(cfg, section).check()]
    if not problems:  # cross-section checks assume each section is valid on its own
        problems = cfg.check()
    if problems:
        lines = "; ".join(f"key {key!r}: {msg}" for key, msg in problems)
        raise ConfigError(f"config {source}: {lines}.")
    return cfg


def _sections() -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(RunConfig)
        if dataclasses.is_dataclass(typing.get_type_hints(RunConfig)[f.name])
    ]


def _build(cls: type, raw: Any, source: str, prefix: str):
    where = prefix.rstrip(".") or "top level"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config {source}: key {where!r} must be a mapping, got {_kind(raw)}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        raise ConfigError(
            f"config {source}: unknown key {prefix + str(unknown[0])!r} in {where}; valid keys are: "
            f"{', '.join(fields)}."
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in raw.items():
        key = prefix + name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, source, prefix=key + ".")
        else:
            kwargs[name] = _coerce(value, hint, source, key)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, source: str, key: str) -> Any:
    """Check ``value`` against a field's type; ints are accepted where floats are expected."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, source, key)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(
                f"config {source}: key {key!r} must be one of {', '.join(map(repr, args))}, got {value!r}."
            )
        return value
    if origin is dict and args[1] is Any:  # a free mapping (recipe_args): plain YAML data, string keys
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"config {source}: key {key!r} must be a mapping with string keys, got {_kind(value)}.")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config {source}: key {key!r} must be a mapping, got {_kind(value)}.")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"config {source}: key {key!r} has a non-string key {k!r}.")
            out[k] = _coerce(
                v if not isinstance(v, int | float) or isinstance(v, bool) else str(v), args[1], source, f"{key}.{k}"
            )
        return out
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config {source}: key {key!r} must be a list, got {_kind(value)}.")
        return [_coerce(v, args[0], source, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config {source}: key {key!r} must be true or false, got {_kind(value)}.")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config {source}: key {key!r} must be an integer, got {_kind(value)}.")
        return value
    if hint is float:
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string: accept plain numeric text
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config {source}: key {key!r} must be a number, got {_kind(value)}.")
        return float(value)
    if hint is str:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # e.g. job.time: 30 (minutes)
        if not isinstance(value, str):
            raise ConfigError(f"config {source}: key {key!r} must be a string, got {_kind(value)}.")
        return value
    raise TypeError(f"unsupported config type {hint!r} for {key}")  # a schema bug, not a user error


def _kind(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def flatten(data: object, prefix: str = "") -> dict[str, object]:
    """A nested mapping as dotted keys (``train.lr``); an empty mapping is a value of its own."""
    if isinstance(data, dict) and data:
        out: dict[str, object] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_hash(cfg: RunConfig) -> str:
    """SHA-256 of the resolved config, stable across key order."""
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()
