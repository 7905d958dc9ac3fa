"""Class environments: a Python class named by reference (`my_env.py:Wordle`, `package.module:Class`, through
`posttrain.loading`), one instance per trajectory, living in a worker process of its own.

The class (constructed with no arguments) must have `reset(record)`, which takes the dataset row and returns
the first user turn as a string or the first messages as a list of `{"role", "content"}` dicts. Its other
public methods are its tools: each needs type hints and a docstring with `Args:` (schemas from
`transformers.utils.get_json_schema`, built here from the class without an instance). Optional:
- `reward(...)` scores the finished trajectory from the environment's own state; it gets those of
  `messages`, `completion` (the last assistant message's text), `record` and `turn_rewards` that it names
  (all of them if it takes `**kwargs`);
- `step(text) -> (observation, reward, done)` for text games without tool calls: the model's turn in, the
  next user turn (or None), this turn's reward and whether the game is over.
Problems in a class are one-line `LoadError`s naming the class and its file.

The class is loaded here only to check it and describe its tools; its instances, and so every call of its code
(construction, `reset`, `step`, `reward`, the tool methods), live in an `ObjectHost`: a worker process per session
that the run's `ToolPool` starts (`EnvironmentSpec.open`), where a call past the time limit is killed with its
process and a crash is noticed at once (`posttrain.agent.environments`).
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path

from posttrain.agent.environments import EnvironmentSpec
from posttrain.loading import LoadError, load_callable
from posttrain.tools import tool_from_callable

__all__ = ["RESERVED", "load_environment"]

RESERVED = ("reset", "reward", "step")


def _one_line(text) -> str:
    return " ".join(str(text).split())


class _Unbound:
    """Stands in for an instance so a method's schema (without `self`) can be built at load time."""


def _where(ref: str) -> str:
    target = ref.rsplit(":", 1)[0]
    return f"file {target!r}" if target.endswith(".py") or "/" in target else f"module {target!r}"


def _worker_ref(ref: str) -> str:
    """`ref` as a worker loads it wherever its working folder is: a file's path made absolute."""
    target, _, attr = ref.strip().rpartition(":")
    if target.endswith(".py") or "/" in target:
        return f"{Path(target).expanduser().resolve()}:{attr}"
    return ref.strip()


def _check_class(cls, ref: str, key: str) -> None:
    name, where = getattr(cls, "__name__", repr(cls)), _where(ref)
    if not inspect.isclass(cls):
        raise LoadError(f"{key}: environment {ref!r} must be a class, got {type(cls).__name__}")
    if not callable(getattr(cls, "reset", None)):
        raise LoadError(f"{key}: environment class {name} in {where} has no reset(record) method")
    required = [p.name for p in inspect.signature(cls).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise LoadError(f"{key}: environment class {name} in {where} must be constructible with no arguments "
                        f"(its __init__ requires {required})")


def load_environment(ref: str, key: str = "rollout.environment") -> EnvironmentSpec:
    """Load and check the environment class `ref` names (errors are one line naming `key` and the file)."""
    try:
        cls = load_callable(ref, what="environment")
    except LoadError as e:
        raise LoadError(f"{key}: {_one_line(e)}") from None
    _check_class(cls, ref, key)
    name, where = cls.__name__, _where(ref)
    names, schemas = [], []
    for attr, fn in inspect.getmembers(cls, inspect.isfunction):
        if attr.startswith("_") or attr in RESERVED:
            continue
        tool = tool_from_callable(types.MethodType(fn, _Unbound()),
                                  what=f"{key}: method {name}.{attr} in {where} (public methods are tools; "
                                       "prefix helpers with '_')")
        names.append(attr)
        schemas.append(tool.schema)
    worker_ref = _worker_ref(ref)
    return EnvironmentSpec(name=name, ref=ref, tool_names=tuple(names), schemas=tuple(schemas),
                           has_step=callable(getattr(cls, "step", None)),
                           has_reward=callable(getattr(cls, "reward", None)),
                           open=lambda pool: pool.host(worker_ref))
