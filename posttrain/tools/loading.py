"""Tools named in a config, loaded like reward functions: a built-in name, `package.module:function` or
`path/to/file.py:function` through `posttrain.loading`, each described by the JSON schema that
`transformers.utils.get_json_schema` builds from its signature and docstring.

A tool needs type hints on every argument and a docstring with a description and an `Args:` entry per
argument; one that lacks them, or cannot be loaded, is a one-line `LoadError` naming the reference (and the
config key, e.g. `rollout.tools[1]`, when given). `tool_from_callable` describes a callable already in hand
(an environment's bound method: it runs in the caller's process, where its state lives).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from posttrain.loading import LoadError, load_callable
from posttrain.tools.calculator import calculator
from posttrain.tools.python_sandbox import python

__all__ = ["BUILTIN_TOOLS", "Tool", "ToolSet", "load_tool", "load_tools", "tool_from_callable", "resolve_tool"]

#: Tools a config may name without a path.
BUILTIN_TOOLS: dict[str, Callable] = {"calculator": calculator, "python": python}


@dataclass(frozen=True)
class Tool:
    """One tool: its name (the schema's), JSON schema, the callable, and the reference it was loaded from
    (None for a callable in hand, which then runs in the caller's process). `runner`, when set, runs the tool
    somewhere else (an environment's method in the worker holding its instance): `runner(arguments, timeout)` ->
    a Future of `(status, text, seconds)` as a tool worker answers, failing with `TimeoutError` past `timeout` or
    `pebble.ProcessExpired` when that worker died."""
    name: str
    schema: dict
    fn: Callable = field(repr=False, compare=False)
    ref: str | None = None
    runner: Callable[[dict, float | None], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def in_process(self) -> bool:
        return self.ref is None and self.runner is None


#: Tools by name, in config order.
ToolSet = dict


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _schema(fn: Callable, what: str) -> dict:
    # lazy: transformers (~0.6 s) loads only when a tool's schema is built
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException, ...
        raise LoadError(f"{what} cannot be described as a tool: {_one_line(e)} (a tool needs type hints on "
                        "every argument and a docstring with a description and an 'Args:' entry per argument)"
                        ) from None


def tool_from_callable(fn: Callable, *, ref: str | None = None, what: str | None = None) -> Tool:
    """The `Tool` for `fn` (`ref`: how a worker process loads it again; None: runs in this process)."""
    schema = _schema(fn, what or f"tool {getattr(fn, '__qualname__', fn)!r}")
    return Tool(name=schema["function"]["name"], schema=schema, fn=fn, ref=ref)


def resolve_tool(ref: str) -> Callable:
    """The callable a tool reference names (raises `LoadError`)."""
    return load_callable(ref, what="tool", builtins=BUILTIN_TOOLS)


def load_tool(ref: Any, key: str | None = None) -> Tool:
    """Load and describe one tool reference; errors name `key` when given."""
    where = f"{key}: " if key else ""
    try:
        fn = resolve_tool(ref)
        return tool_from_callable(fn, ref=ref.strip(), what=f"tool {ref!r}")
    except LoadError as e:
        raise LoadError(where + _one_line(e)) from None


def load_tools(refs: Sequence[Any], key: str = "rollout.tools") -> ToolSet:
    """Tools by name from a list of references; two tools with one name are an error."""
    if isinstance(refs, str) or not isinstance(refs, Sequence):
        raise LoadError(f"{key}: expected a list of tool references, got {type(refs).__name__}")
    tools: ToolSet = {}
    for i, ref in enumerate(refs):
        tool = load_tool(ref, f"{key}[{i}]")
        if tool.name in tools:
            raise LoadError(f"{key}[{i}]: tool name {tool.name!r} (from {ref!r}) is already taken by "
                            f"{tools[tool.name].ref!r}")
        tools[tool.name] = tool
    return tools
