"""Environments: a class named by reference (`my_env.py:Wordle`, `package.module:Class`, through
`posttrain.loading`), one instance per trajectory.

The class (constructed with no arguments) must have `reset(record)`, which takes the dataset row and returns
the first user turn as a string or the first messages as a list of `{"role", "content"}` dicts. Its other
public methods are its tools: each needs type hints and a docstring with `Args:` (schemas from
`transformers.utils.get_json_schema` on the bound method); they run in the rollout's process, on the
trajectory's instance, where the state lives. Optional:
- `reward(...)` scores the finished trajectory from the environment's own state; it gets those of
  `messages`, `completion` (the last assistant message's text), `record` and `turn_rewards` that it names
  (all of them if it takes `**kwargs`);
- `step(text) -> (observation, reward, done)` for text games without tool calls: the model's turn in, the
  next user turn (or None), this turn's reward and whether the game is over.
Per-turn rewards (from `step`) are summed, undiscounted, and the final `reward(...)` is added:
`trajectory_reward` gives the one number per trajectory that group advantages use.
Problems in a class are one-line `LoadError`s naming the class and its file; exceptions raised by a
trajectory's `step` or `reward` are caught and returned as error text, never raised.
"""

from __future__ import annotations

import inspect
import math
import types
from dataclasses import dataclass
from typing import Any, Sequence

from posttrain.loading import LoadError, load_callable
from posttrain.tools import Tool, tool_from_callable

__all__ = ["EnvironmentSpec", "EnvSession", "StepResult", "load_environment", "trajectory_reward"]

RESERVED = ("reset", "reward", "step")


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


class _Unbound:
    """Stands in for an instance so a method's schema (without `self`) can be built at load time."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """A loaded environment class: its reference, the tool schemas of its methods, and what it defines."""
    cls: type
    ref: str
    tool_names: tuple[str, ...]
    schemas: tuple[dict, ...]
    has_step: bool
    has_reward: bool

    def make(self) -> "EnvSession":
        """A fresh instance for one trajectory."""
        return EnvSession(self)


def _where(ref: str) -> str:
    target = ref.rsplit(":", 1)[0]
    return f"file {target!r}" if target.endswith(".py") or "/" in target else f"module {target!r}"


def load_environment(ref: str, key: str = "rollout.environment") -> EnvironmentSpec:
    """Load and check the environment class `ref` names (errors are one line naming `key` and the file)."""
    try:
        cls = load_callable(ref, what="environment")
    except LoadError as e:
        raise LoadError(f"{key}: {_one_line(e)}") from None
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
    names, schemas = [], []
    for attr, fn in inspect.getmembers(cls, inspect.isfunction):
        if attr.startswith("_") or attr in RESERVED:
            continue
        tool = tool_from_callable(types.MethodType(fn, _Unbound()),
                                  what=f"{key}: method {name}.{attr} in {where} (public methods are tools; "
                                       "prefix helpers with '_')")
        names.append(attr)
        schemas.append(tool.schema)
    return EnvironmentSpec(cls=cls, ref=ref, tool_names=tuple(names), schemas=tuple(schemas),
                           has_step=callable(getattr(cls, "step", None)),
                           has_reward=callable(getattr(cls, "reward", None)))


@dataclass(frozen=True)
class StepResult:
    """One `step`: the next user turn (None: none), this turn's reward, whether the game is over, and the
    error text when the environment's `step` failed (then `done` is True)."""
    observation: str | None
    reward: float
    done: bool
    error: str | None = None


class EnvSession:
    """One trajectory's environment instance, with its tools and the rewards it gave so far."""

    def __init__(self, spec: EnvironmentSpec):
        self.spec = spec
        self.env = spec.cls()
        self.tools: dict[str, Tool] = {
            schema["function"]["name"]: Tool(name=schema["function"]["name"], schema=schema,
                                             fn=getattr(self.env, attr), ref=None)
            for attr, schema in zip(spec.tool_names, spec.schemas)}
        self.turn_rewards: list[float] = []

    def reset(self, record: dict) -> list[dict]:
        """The first messages for `record` (raises ValueError naming the class if `reset` returns junk)."""
        out = self.env.reset(record)
        if isinstance(out, str):
            return [{"role": "user", "content": out}]
        if isinstance(out, Sequence) and out and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in out):
            return [dict(m) for m in out]
        raise ValueError(f"{self.spec.cls.__name__}.reset must return a string or a list of "
                         f"{{'role', 'content'}} messages, got {type(out).__name__}")

    def step(self, text: str) -> StepResult:
        """The environment's answer to the model's turn `text` (for `step` environments)."""
        try:
            out = self.env.step(text)
            observation, reward, done = out
            if observation is not None and not isinstance(observation, str):
                raise TypeError(f"observation must be a string or None, got {type(observation).__name__}")
            reward = float(reward)
            if not math.isfinite(reward):
                raise ValueError(f"reward {reward} is not finite")
        except Exception as e:
            return StepResult(None, 0.0, True, f"{self.spec.cls.__name__}.step failed: {type(e).__name__}: {e}")
        self.turn_rewards.append(reward)
        return StepResult(observation, reward, bool(done))

    def final_reward(self, messages: Sequence[dict], record: dict | None = None) -> tuple[float | None, str | None]:
        """`(reward, error)` from the environment's `reward(...)`: `(None, None)` when it has none."""
        if not self.spec.has_reward:
            return None, None
        completion = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        offered = {"messages": list(messages), "completion": completion, "record": record,
                   "turn_rewards": list(self.turn_rewards)}
        try:
            params = inspect.signature(self.env.reward).parameters
            takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
            value = float(self.env.reward(**{k: v for k, v in offered.items() if takes_all or k in params}))
            if not math.isfinite(value):
                raise ValueError(f"reward {value} is not finite")
            return value, None
        except Exception as e:
            return None, f"{self.spec.cls.__name__}.reward failed: {type(e).__name__}: {e}"


def trajectory_reward(turn_rewards: Sequence[float], final: float | None) -> float:
    """One number per trajectory: the per-turn rewards summed (undiscounted) plus the final reward."""
    return float(sum(turn_rewards)) + (0.0 if final is None else float(final))
