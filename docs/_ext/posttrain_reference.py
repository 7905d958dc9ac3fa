"""Sphinx extension: writes the generated reference pages (the CLI, every config key) before the docs are read.

- The CLI page holds `posttrain --help` and every subcommand's help, from the parsers that
  `posttrain.cli.main.build_parser()` builds (what the command prints, at a fixed width).
- One config page per training command (sft, rl, dpo, distill) lists every key of its typed config, found by
  walking the dataclass fields from the root config (`SFTConfig`, `RLConfig`, `DPOConfig`, `DistillConfig`):
  dotted key, type, default (that command's: RL's `optim.lr` is not SFT's) and meaning.
- The server's request bodies (`posttrain serve`): every field of the pydantic models the server validates
  requests with (`posttrain.serve.protocol`), with its type, default and meaning (the same `key: meaning` lines).

Meanings come from the project's one convention: a `key: meaning` line in the docstring of the config class that
declares the key (or of a class it inherits from), continued on more indented lines; `a, b: meaning` describes
both. A section (a nested dataclass) is described by its class docstring's first paragraph. `missing_keys()`
lists the keys without a description (tests/test_docs_reference.py reports them). The pages are written under
docs/reference/generated/ (not kept in git).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

HERE = Path(__file__).resolve().parent
GENERATED = HERE.parent / "reference" / "generated"

#: The training commands and their root config classes.
ROOTS = {"sft": ("posttrain.training.config", "SFTConfig"), "rl": ("posttrain.rl.config", "RLConfig"),
         "dpo": ("posttrain.training.dpo", "DPOConfig"), "distill": ("posttrain.distill.config", "DistillConfig")}

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_KEY_LINE = re.compile(rf"^(\s*)((?:`?{_NAME}`?)(?:(?:,\s*|\s+x\s+|\s+and\s+)`?{_NAME}`?)*):\s+(\S.*)$")


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: its dotted name, type, default, meaning (None: none written) and where it is declared."""

    key: str
    type: str
    default: str
    description: str | None
    declared_in: type
    section: bool = False


def root_class(command: str) -> type:
    module, name = ROOTS[command]
    return getattr(importlib.import_module(module), name)


def parse_descriptions(doc: str | None, names: set[str]) -> dict[str, str]:
    """`{field: meaning}` from `key: meaning` lines of a docstring (only keys in `names`; a head naming anything
    else is prose, not a key line)."""
    out: dict[str, str] = {}
    lines = inspect.cleandoc(doc or "").splitlines()
    i = 0
    while i < len(lines):
        m = _KEY_LINE.match(lines[i])
        heads = [h.strip("`") for h in re.split(r",\s*|\s+x\s+|\s+and\s+", m.group(2))] if m else []
        if not heads or not set(heads) <= names:
            i += 1
            continue
        indent, text = len(m.group(1)), [m.group(3)]
        i += 1
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > indent:
            text.append(lines[i].strip())
            i += 1
        for h in heads:
            out.setdefault(h, " ".join(text))
    return out


def descriptions(cls: type) -> dict[str, str]:
    """Meanings of `cls`'s fields from its docstring and its bases' (the class's own first)."""
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    for c in cls.__mro__:
        if c is object or summary(c) is None:
            continue
        for k, v in parse_descriptions(c.__dict__["__doc__"], names).items():
            out.setdefault(k, v)
    return out


def summary(cls: type) -> str | None:
    """A class's own docstring's first paragraph, on one line (None: it has none)."""
    doc = cls.__dict__.get("__doc__")
    if not doc or doc.startswith(f"{cls.__name__}("):  # none written (dataclasses make one of the signature)
        return None
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def declared_in(cls: type, name: str) -> type:
    """The base-most class declaring field `name`: where its description belongs (subclasses inherit it)."""
    owners = [c for c in cls.__mro__ if name in inspect.get_annotations(c)]
    return owners[-1] if owners else cls


def type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin is Union or type(tp).__name__ == "UnionType":
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def shown(value: Any) -> str:
    """A default as YAML writes it (one line)."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, list):
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    if value == "":
        return '""'
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def walk(cls: type, instance: Any, prefix: str = "") -> list[Key]:
    """Every key under `instance` (a `cls`), sections first then their keys, in declaration order."""
    hints = typing.get_type_hints(cls)
    meaning = descriptions(cls)
    out: list[Key] = []
    for f in dataclasses.fields(cls):
        tp, value, key = hints[f.name], getattr(instance, f.name), prefix + f.name
        owner = declared_in(cls, f.name)
        args = typing.get_args(tp)
        item = args[0] if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]) else None
        if dataclasses.is_dataclass(value):
            out.append(Key(key, type_name(tp), "", meaning.get(f.name) or summary(type(value)), owner, True))
            out += walk(type(value), value, key + ".")
        elif item is not None:
            out.append(Key(key, type_name(tp), shown(value), meaning.get(f.name) or summary(item), owner, True))
            out += walk(item, item(), key + "[].")
        else:
            out.append(Key(key, type_name(tp), shown(value), meaning.get(f.name), owner))
    return out


def keys(command: str) -> list[Key]:
    cls = root_class(command)
    return walk(cls, cls())


def missing_keys() -> list[tuple[str, str, str]]:
    """`(file, class, field)` of every key of any command without a meaning, each once."""
    out = set()
    for command in ROOTS:
        for k in keys(command):
            if not k.description:
                path = Path(inspect.getfile(k.declared_in))
                rel = path.relative_to(path.parents[len(k.declared_in.__module__.split(".")) - 1])
                out.add((rel.as_posix(), k.declared_in.__name__, k.key.rpartition(".")[2].removesuffix("[]")))
    return sorted(out)


def config_page(command: str) -> str:
    cls = root_class(command)
    lines = [f"# `posttrain {command}` config keys", "",
             (f"Generated from `{cls.__module__}.{cls.__name__}` and the docstrings of its sections. Set a key in "
              "the YAML file (nested as the dots say) or on the command line as `key=value`; "
              "`rewards.functions[]` keys are those of each item of a list."), ""]
    for k in keys(command):
        text = k.description or "(no description yet)"
        if k.section:
            depth = k.key.count(".") + 2
            lines += ["", f"{'#' * min(depth, 6)} `{k.key}`", "", text, ""]
            if k.default:
                lines += [f"Type `{k.type}`, default `{k.default}`.", ""]
        else:
            lines.append(f"- **`{k.key}`** (`{k.type}`, default `{k.default}`): {text}")
    return "\n".join(_no_loose_html(lines)) + "\n"


def _no_loose_html(lines: list[str]) -> list[str]:
    """`<` outside code spans escaped, so that `<tool_call>` in a description shows as text."""
    def fix(line: str) -> str:
        parts = line.split("`")
        return "`".join(p.replace("<", "\\<") if i % 2 == 0 else p for i, p in enumerate(parts))
    return [fix(x) for x in lines]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subcommands on the subparsers action only
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_page() -> str:
    from posttrain.cli.main import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps help at the terminal's width
    try:
        parser = build_parser()
        lines = ["# Command-line reference", "",
                 ("Generated from the parsers of `posttrain.cli.main.build_parser()`: what `posttrain COMMAND "
                  "--help` prints."), "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub in subparsers(parser).items():
            lines += [f"## `posttrain {name}`", "", sub.description or "", "", "```text",
                      sub.format_help().rstrip(), "```", ""]
            for action, inner in subparsers(sub).items():  # `posttrain models fetch`, ...
                lines += [f"### `posttrain {name} {action}`", "", "```text", inner.format_help().rstrip(), "```", ""]
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(lines)


#: The request bodies of `posttrain serve`, in the order the page shows them (`posttrain.serve.protocol`).
SERVE_MODELS = ["CompletionRequest", "ChatRequest", "SamplingFields", "StreamOptions", "ChatMessage", "ContentPart",
                "ImageURL", "ToolCall", "FunctionCall", "Tool", "FunctionDef", "TokenizeRequest", "DetokenizeRequest"]


def _bounded(tp: Any) -> str:
    """A type with `Annotated[T, bounds]` written as `T (>= a, <= b)`."""
    if typing.get_origin(tp) is typing.Annotated:
        inner, *meta = typing.get_args(tp)
        bounds = [f"{op} {getattr(m, key)}" for m in meta for key, op in
                  (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if getattr(m, key, None) is not None]
        return _bounded(inner) + (f" ({', '.join(bounds)})" if bounds else "")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union or type(tp).__name__ == "UnionType":
        return " | ".join(_bounded(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_bounded(a) for a in args)}]"
    return type_name(tp)


def _field_type(info) -> str:
    """A pydantic field's type, bounds written out (`int (>= 0)`); a bound on the field itself appended."""
    own = [f"{op} {getattr(m, key)}" for m in info.metadata for key, op in
           (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if getattr(m, key, None) is not None]
    return _bounded(info.annotation) + (f" ({', '.join(own)})" if own else "")


def serve_fields(name: str) -> list[tuple[str, str, str, str | None]]:
    """(field, type, default, meaning) of a request model's own fields (inherited ones are shown on their class)."""
    from pydantic_core import PydanticUndefined

    from posttrain.serve import protocol

    cls = getattr(protocol, name)
    own = [k for k in cls.model_fields if k in inspect.get_annotations(cls)]
    meaning = parse_descriptions(cls.__doc__, set(own))
    out = []
    for k in own:
        info = cls.model_fields[k]
        default = "required" if info.default is PydanticUndefined else shown(info.default)
        out.append((k, _field_type(info), default, meaning.get(k)))
    return out


def serve_page() -> str:
    from posttrain.serve import protocol

    lines = ["# `posttrain serve` request bodies", "",
             ("Generated from the pydantic models the server validates request bodies with "
              "(`posttrain.serve.protocol`). Types are strict (a string is not a number); a field of the wrong type "
              "or out of range is a 400 naming it (`error.param`); other fields are accepted and ignored."), ""]
    for name in SERVE_MODELS:
        cls = getattr(protocol, name)
        bases = [b.__name__ for b in cls.__bases__ if b.__name__ in SERVE_MODELS]
        lines += [f"## `{name}`", "", summary(cls) or "", ""]
        if bases:
            lines += [f"Also every field of `{bases[0]}`.", ""]
        for k, tp, default, text in serve_fields(name):
            lines.append(f"- **`{k}`** (`{tp}`, default `{default}`): {text or '(no description yet)'}")
        lines.append("")
    return "\n".join(_no_loose_html(lines)) + "\n"


def write_pages(folder: Path = GENERATED) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    pages = {"cli.md": cli_page(), **{f"config-{c}.md": config_page(c) for c in ROOTS}, "serve-requests.md": serve_page()}
    out = []
    for name, text in pages.items():
        path = folder / name
        if not path.exists() or path.read_text() != text:  # unchanged pages keep their time: no rebuild
            path.write_text(text)
        out.append(path)
    return out


def _on_builder_inited(app) -> None:
    write_pages()


def setup(app):
    app.connect("builder-inited", _on_builder_inited)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
