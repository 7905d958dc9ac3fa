"""Typed configuration machinery: YAML file + dotted `key=value` overrides -> nested dataclasses.

Configs are trees of `@dataclass`es. `load_config(cls, path, overrides)` reads a
YAML file, applies command-line overrides such as `trainer.max_steps=10`, and
builds the dataclass tree while checking every value against its annotation
(int, float, bool, str, Literal, Optional/Union, list, tuple, dict[str, ...],
nested dataclasses, Path). Errors are `ConfigError`s that name the full dotted
key. `to_dict` / `save_config` write the resolved config back as YAML.
Area-specific config classes live with their areas, not here.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, TypeVar, Union

import yaml

__all__ = [
    "ConfigError",
    "load_config",
    "from_dict",
    "apply_overrides",
    "parse_overrides",
    "config_from_argv",
    "to_dict",
    "save_config",
    "yaml_load",
    "at_least",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem: unknown key, ill-typed value, missing field, bad YAML."""


def at_least(key: str, value: float | None, minimum: float, note: str = "") -> None:
    """A section's `__post_init__` check: ValueError "KEY must be >= MINIMUM (NOTE), found VALUE" when `value`
    is below `minimum` (None, an unset optional, passes); `from_dict` reports it as a ConfigError."""
    if value is not None and value < minimum:
        raise ValueError(f"{key} must be >= {minimum}{f' ({note})' if note else ''}, found {value}")


# ---------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-4`, `3E5`, `-2e+3` as floats (YAML 1.2 style)."""


_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def yaml_load(text: str, *, source: str = "<string>") -> Any:
    """Parse YAML text; a syntax error becomes a ConfigError naming `source` and the line."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        if mark is not None:
            raise ConfigError(
                f"{source}:{mark.line + 1}:{mark.column + 1}: YAML parse error (line {mark.line + 1}): "
                f"{problem}") from e
        raise ConfigError(f"{source}: YAML parse error: {problem}") from e


# ---------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Override:
    """A command-line value: its raw text (used for `str` fields) and its YAML parse."""
    text: str
    parsed: Any


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, _Override]]:
    """Split `a.b=value` strings into (dotted key, value) pairs."""
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.max_steps=10)")
        key, text = item.split("=", 1)
        key = key.strip()
        if key.startswith("--"):
            key = key[2:]
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key")
        out.append((key, _Override(text, yaml_load(text, source=f"override '{item}'"))))
    return out


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Set each dotted `key=value` of `overrides` in the nested dict `data` (in place; returned).

    Intermediate dicts are created as needed; a numeric part indexes into a list
    (`rewards.0.weight=2`).
    """
    for key, value in parse_overrides(overrides):
        parts = key.split(".")
        node: Any = data
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                node = node[_list_index(node, part, where)]
                continue
            nxt = node.get(part)
            if not isinstance(nxt, (dict, list)):
                nxt = {}
                node[part] = nxt
            node = nxt
        last = parts[-1]
        if isinstance(node, list):
            node[_list_index(node, last, key)] = value
        else:
            node[last] = value
    return data


def _list_index(node: list, part: str, where: str) -> int:
    if not part.lstrip("-").isdigit():
        raise ConfigError(f"override key '{where}': '{part}' must be a list index (the value there is a list)")
    idx = int(part)
    if not -len(node) <= idx < len(node):
        raise ConfigError(f"override key '{where}': index {idx} out of range for a list of {len(node)}")
    return idx


# ---------------------------------------------------------------------------
# dict -> dataclass
# ---------------------------------------------------------------------------

def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = typing.get_args(tp)
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]" if args else name
    return getattr(tp, "__name__", str(tp))


def _bad(key: str, tp: Any, value: Any, extra: str = "") -> ConfigError:
    shown = value.text if isinstance(value, _Override) else value
    kind = type(_unwrap(value)).__name__
    return ConfigError(
        f"config key '{key or '<root>'}': expected {_type_name(tp)}, found {shown!r} ({kind}){extra}")


def _unwrap(value: Any) -> Any:
    return value.parsed if isinstance(value, _Override) else value


def _is_scalar_type(tp: Any) -> bool:
    return tp in (bool, int, float, str, Path, os.PathLike) or typing.get_origin(tp) is Literal


def _convert(tp: Any, value: Any, key: str) -> Any:
    """`value` (a YAML value, or an `_Override` from the command line) checked against annotation `tp` and
    converted to it; a ConfigError names `key`. One function per kind of annotation below."""
    if tp is Any or tp is object:
        return _unwrap(value)
    origin = typing.get_origin(tp) or tp
    if origin in (Union, types.UnionType):
        return _to_union(tp, value, key)
    if origin is Literal:
        return _to_literal(tp, value, key)
    if tp is str:
        return _to_str(value, key)
    raw = _unwrap(value)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _to_dataclass(tp, raw, key)
    if tp in _SCALARS:
        accepts, convert = _SCALARS[tp]
        if accepts(raw):
            return convert(raw)
        raise _bad(key, tp, raw)
    if origin in _CONTAINERS:
        return _CONTAINERS[origin](tp, raw, key)
    if isinstance(tp, type):
        return _to_class(tp, raw, key)
    raise ConfigError(f"config key '{key}': unsupported annotation {tp!r}")


def _to_union(tp: Any, value: Any, key: str) -> Any:
    args = typing.get_args(tp)
    if _unwrap(value) is None and type(None) in args:
        return None
    # str last so `1` for `int | str` stays an int.
    members = sorted((a for a in args if a is not type(None)), key=lambda a: a is str)
    for member in members:
        try:
            return _convert(member, value, key)
        except ConfigError:
            # A structured member (dataclass/container) reports its own, more precise error.
            if len(members) == 1 and not _is_scalar_type(member):
                raise
    raise _bad(key, tp, value)


def _to_literal(tp: Any, value: Any, key: str) -> Any:
    args, raw = typing.get_args(tp), _unwrap(value)
    for allowed in args:
        if raw == allowed and type(raw) is type(allowed):
            return allowed
    if isinstance(value, _Override):  # `kind=1` for Literal["1", ...]
        for allowed in args:
            if isinstance(allowed, str) and value.text == allowed:
                return allowed
    raise ConfigError(f"config key '{key}': invalid value {raw!r}; accepted values: " + ", ".join(map(repr, args)))


def _to_str(value: Any, key: str) -> str:
    # A scalar command-line value for a str field is taken verbatim (`run=0123` -> "0123").
    if isinstance(value, _Override) and isinstance(value.parsed, (str, int, float, bool)):
        return value.text
    if isinstance(value, str):
        return value
    raise _bad(key, str, value)


def _to_dataclass(tp: type, value: Any, key: str) -> Any:
    if isinstance(value, tp):
        return value
    if not isinstance(value, dict):
        raise _bad(key, tp, value, " (expected a mapping)")
    return from_dict(tp, value, prefix=key)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# scalar annotation -> (which YAML values it accepts, conversion)
_SCALARS: dict[Any, tuple[Callable[[Any], bool], Callable[[Any], Any]]] = {
    bool: (lambda v: isinstance(v, bool), lambda v: v),
    int: (lambda v: _is_number(v) and (isinstance(v, int) or v.is_integer()), int),
    float: (_is_number, float),
    type(None): (lambda v: v is None, lambda v: None),
    Path: (lambda v: isinstance(v, (str, Path)), Path),
    os.PathLike: (lambda v: isinstance(v, (str, Path)), Path),
}


def _to_list(tp: Any, value: Any, key: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise _bad(key, tp, value)
    item_tp = (typing.get_args(tp) or (Any,))[0]
    return [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]


def _to_tuple(tp: Any, value: Any, key: str) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise _bad(key, tp, value)
    args = typing.get_args(tp)
    if not args or (len(args) == 2 and args[1] is Ellipsis):  # tuple or tuple[X, ...]: any length
        return tuple(_to_list(tp, value, key))
    if len(args) != len(value):
        raise _bad(key, tp, value, f" (expected {len(args)} items)")
    return tuple(_convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))


def _to_mapping(tp: Any, value: Any, key: str) -> dict:
    if not isinstance(value, dict):
        raise _bad(key, tp, value)
    k_tp, v_tp = typing.get_args(tp) or (Any, Any)
    out = {}
    for k, v in value.items():
        sub = f"{key}.{k}" if key else str(k)
        out[_convert(k_tp, k, sub)] = _convert(v_tp, v, sub)
    return out


_CONTAINERS = {list: _to_list, collections.abc.Sequence: _to_list, tuple: _to_tuple, dict: _to_mapping}


def _to_class(tp: type, value: Any, key: str) -> Any:
    """An Enum (by value or name) or any other class (an instance of it)."""
    if issubclass(tp, enum.Enum):
        for member in tp:
            if value == member.value or value == member.name:
                return member
        raise ConfigError(f"config key '{key}': invalid value {value!r}; accepted values: "
                          + ", ".join(repr(m.value) for m in tp))
    if isinstance(value, tp):
        return value
    raise _bad(key, tp, value)


def from_dict(cls: type[T], data: dict | None, *, prefix: str = "") -> T:
    """Build dataclass `cls` from a nested dict, checking keys and types (see module doc).

    A key listed in the class's `MOVED_KEYS` ({old key: its new full key}) is an error naming the new key.
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"{cls!r} is not a dataclass type")
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise _bad(prefix, cls, data, " (expected a mapping)")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    _check_keys(cls, data, prefix, [f.name for f in fields])
    hints = typing.get_type_hints(cls)
    kwargs = {}
    missing = []
    for f in fields:
        full = f"{prefix}.{f.name}" if prefix else f.name
        sub = hints[f.name]
        section = dataclasses.is_dataclass(sub) and isinstance(sub, type)
        if f.name in data:
            value = data[f.name]
            if section and isinstance(value, dict) and f.default_factory is not dataclasses.MISSING:
                # a section given in part keeps its field's own defaults (e.g. RL's optim lr), not the class's
                value = _merged(to_dict(f.default_factory()), value)
            kwargs[f.name] = _convert(sub, value, full)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if section:
                # A required nested section that was not given: build it from defaults, so
                # the error (if any) names the innermost missing keys.
                kwargs[f.name] = from_dict(sub, {}, prefix=full)
            else:
                missing.append(full)
    if missing:
        raise ConfigError("missing required config field(s): " + ", ".join(f"'{m}'" for m in missing))
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config '{prefix or cls.__name__}': {e}") from e


def _check_keys(cls: type, data: dict, prefix: str, names: list[str]) -> None:
    moved = getattr(cls, "MOVED_KEYS", {})
    for k in data:
        if k in names:
            continue
        full = f"{prefix}.{k}" if prefix else str(k)
        if k in moved:
            raise ConfigError(f"config key {full} moved to {moved[k]}")
        level = f"'{prefix}'" if prefix else "the top level"
        raise ConfigError(
            f"unknown config key '{full}'; valid keys at {level} ({cls.__name__}): {', '.join(names)}")


def _merged(base: dict, given: dict) -> dict:
    """`given` over `base`, recursively for mappings (lists and scalars in `given` replace)."""
    out = dict(base)
    for k, v in given.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(cls: type[T], path: str | os.PathLike | None = None,
                overrides: Sequence[str] = ()) -> T:
    """Read YAML `path` (None: all defaults), apply `key=value` overrides, build `cls`."""
    data: Any = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        data = yaml_load(p.read_text(), source=str(p))
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{p}' must contain a mapping at the top level, "
                              f"found {type(data).__name__}")
    data = apply_overrides(data, overrides)
    return from_dict(cls, data)


def config_from_argv(cls: type[T], argv: Sequence[str]) -> T:
    """`[--config FILE] key=value ...` -> `cls` (a tiny helper for command-line entry points)."""
    path = None
    rest = []
    it = iter(argv)
    for arg in it:
        if arg in ("--config", "-c"):
            try:
                path = next(it)
            except StopIteration:
                raise ConfigError(f"{arg} needs a file argument") from None
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return load_config(cls, path, rest)


# ---------------------------------------------------------------------------
# dataclass -> dict / YAML
# ---------------------------------------------------------------------------

def to_dict(cfg: Any) -> Any:
    """Plain nested dict/list/scalar form of a config (dataclasses, tuples, Paths, Enums converted)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {str(k) if isinstance(k, Path) else k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Path):
        return str(cfg)
    if isinstance(cfg, enum.Enum):
        return cfg.value
    return cfg


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (parent directories created)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, allow_unicode=True))
