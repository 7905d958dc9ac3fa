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
Problems in a class are one-line `LoadError`s naming the class and its file.

A session's calls into the instance (construction and `reset`, `step`, `reward`; its tool methods run through
`ToolPool`) have the time limit of tool calls (`make(timeout_s)`; None: none). Each runs in a daemon thread
(`posttrain.tools.in_process`): one past the limit is abandoned, still running, so the instance is lost. A call
that times out, raises or returns the wrong type is an `EnvFailure` (method, kind, one line of text), the first of
which the session keeps in `failure`: `reset` raises it as `EnvCallError`, `step` and `reward` return its text.
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import math
import types
from dataclasses import dataclass
from typing import Any, Sequence

from posttrain.loading import LoadError, load_callable
from posttrain.tools import Tool, tool_from_callable
from posttrain.tools.in_process import DeadlineExceeded, call_within, settle_within

__all__ = ["EnvCallError", "EnvFailure", "EnvironmentSpec", "EnvSession", "StepResult", "load_environment",
           "trajectory_reward"]

#: `EnvFailure.kind` values: the call ran past its time limit, raised, or returned the wrong type.
FAILURE_KINDS = ("timeout", "exception", "bad_type")

RESERVED = ("reset", "reward", "step")


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


class _Unbound:
    """Stands in for an instance so a method's schema (without `self`) can be built at load time."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """A loaded environment class: its reference, the tool schemas of its methods, and what it defines; `closes`:
    its instances hold a connection that `close()` ends (an OpenEnv session: `posttrain.agent.env_openenv`),
    called when the trajectory ends or a call fails."""
    cls: type
    ref: str
    tool_names: tuple[str, ...]
    schemas: tuple[dict, ...]
    has_step: bool
    has_reward: bool
    closes: bool = False

    def make(self, timeout_s: float | None = None) -> "EnvSession":
        """A fresh session for one trajectory, its calls limited to `timeout_s` seconds each (None: no limit)."""
        return EnvSession(self, timeout_s)


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


@dataclass(frozen=True)
class EnvFailure:
    """A failed call into an environment: the method (`reset`, `step`, `reward`, a tool method's name), how it
    failed (`FAILURE_KINDS`) and one line of text naming the class."""
    method: str
    kind: str
    text: str

    @property
    def label(self) -> str:
        """What the run warns about once: the method and the kind, e.g. `step timeout`."""
        return f"{self.method} {self.kind}"


class EnvCallError(RuntimeError):
    """`reset` failed (see `EnvFailure`); the message is its one line."""

    def __init__(self, failure: EnvFailure):
        super().__init__(failure.text)
        self.failure = failure


class _BadType(TypeError):
    """An environment method returned something of the wrong type."""


def _check_messages(out: Any, name: str) -> list[dict]:
    if isinstance(out, str):
        return [{"role": "user", "content": out}]
    if isinstance(out, Sequence) and out and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in out):
        return [dict(m) for m in out]
    raise _BadType(f"{name}.reset must return a string or a list of {{'role', 'content'}} messages, "
                   f"got {type(out).__name__}")


def _check_step(out: Any, name: str) -> StepResult:
    if not (isinstance(out, tuple | list) and len(out) == 3):
        raise _BadType(f"{name}.step must return (observation, reward, done), got {type(out).__name__}")
    observation, reward, done = out
    if observation is not None and not isinstance(observation, str):
        raise _BadType(f"{name}.step: observation must be a string or None, got {type(observation).__name__}")
    return StepResult(observation, _check_number(reward, f"{name}.step"), bool(done))


def _check_number(value: Any, what: str) -> float:
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise _BadType(f"{what}: reward must be a number, got {type(value).__name__}") from None
    if not math.isfinite(number):
        raise _BadType(f"{what}: reward {value} is not finite")
    return number


class EnvSession:
    """One trajectory's environment instance (made by `reset`), its tools, the rewards it gave so far, and its
    first failure (`failure`; see the module docstring)."""

    def __init__(self, spec: EnvironmentSpec, timeout_s: float | None = None):
        self.spec = spec
        self.timeout_s = timeout_s
        self.env: Any = None
        self.tools: dict[str, Tool] = {}
        self.turn_rewards: list[float] = []
        self.failure: EnvFailure | None = None

    @property
    def name(self) -> str:
        return self.spec.cls.__name__

    def fail(self, method: str, kind: str, text: str) -> EnvFailure:
        """Records a failure (the session keeps the first), closes the instance's connection, and returns it."""
        failure = EnvFailure(method, kind, _one_line(text))
        self.failure = self.failure or failure
        self.close()
        return failure

    def close(self) -> None:
        """End the instance's connection (`EnvironmentSpec.closes`; nothing otherwise); safe more than once."""
        if self.spec.closes and self.env is not None:
            try:
                self.env.close()
            except Exception:  # noqa: BLE001 - our own client's close: best effort
                pass

    def failed(self, method: str, e: BaseException) -> EnvFailure:
        """Records the failure of a call to `method` that raised `e` (`DeadlineExceeded`: it timed out)."""
        if isinstance(e, DeadlineExceeded):
            return self.fail(method, "timeout", f"{self.name}.{method} ran past its {self.timeout_s:g}s time limit "
                                                "(its thread was abandoned)")
        if isinstance(e, _BadType):
            return self.fail(method, "bad_type", str(e))
        return self.fail(method, "exception", f"{self.name}.{method} failed: {type(e).__name__}: {e}")

    def _make_and_reset(self, record: dict) -> list[dict]:
        self.env = self.spec.cls()
        messages = _check_messages(self.env.reset(record), self.name)
        self.tools = {schema["function"]["name"]: Tool(name=schema["function"]["name"], schema=schema,
                                                       fn=getattr(self.env, attr), ref=None)
                      for attr, schema in zip(self.spec.tool_names, self.spec.schemas)}
        return messages

    def reset(self, record: dict) -> list[dict]:
        """A fresh instance and its first messages for `record`; raises `EnvCallError` (one line naming the class)
        when construction or `reset` times out, raises or returns junk."""
        try:
            return call_within(self._make_and_reset, self.timeout_s, record, name=f"{self.name}.reset")
        except (Exception, SystemExit) as e:  # the user's code: sys.exit() in it fails the call, not the run
            raise EnvCallError(self.failed("reset", e)) from None

    def _step_result(self, text: str) -> StepResult:
        try:
            res = _check_step(self.env.step(text), self.name)
        except (Exception, SystemExit) as e:
            return StepResult(None, 0.0, True, self.failed("step", e).text)
        if self.failure is None:  # an abandoned step that returns late adds nothing
            self.turn_rewards.append(res.reward)
        return res

    def step_future(self, text: str) -> cf.Future:
        """A Future of the environment's `StepResult` for the model's turn `text` (never blocks; a timed-out,
        raising or ill-typed `step` gives a result with `error`, done)."""
        def timed_out() -> StepResult:
            return StepResult(None, 0.0, True, self.failed("step", DeadlineExceeded()).text)

        return settle_within(cf.Future(), self.timeout_s, lambda: self._step_result(text), timed_out,
                             name=f"{self.name}.step")

    def step(self, text: str) -> StepResult:
        """`step_future(text)`, waited for."""
        return self.step_future(text).result()

    def _reward(self, offered: dict) -> float:
        params = inspect.signature(self.env.reward).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        value = self.env.reward(**{k: v for k, v in offered.items() if takes_all or k in params})
        return _check_number(value, f"{self.name}.reward")

    def final_reward(self, messages: Sequence[dict], record: dict | None = None) -> tuple[float | None, str | None]:
        """`(reward, error)` from the environment's `reward(...)`: `(None, None)` when it has none."""
        if not self.spec.has_reward:
            return None, None
        completion = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        offered = {"messages": list(messages), "completion": completion, "record": record,
                   "turn_rewards": list(self.turn_rewards)}
        try:
            return call_within(self._reward, self.timeout_s, offered, name=f"{self.name}.reward"), None
        except (Exception, SystemExit) as e:
            return None, self.failed("reward", e).text


def trajectory_reward(turn_rewards: Sequence[float], final: float | None) -> float:
    """One number per trajectory: the per-turn rewards summed (undiscounted) plus the final reward."""
    return float(sum(turn_rewards)) + (0.0 if final is None else float(final))
