"""Environments behind one protocol: what a multi-turn rollout asks of the world its trajectory plays in.

An `EnvironmentSpec` is a loaded environment of some kind (today a Python class, `posttrain.agent.env_classes`;
OpenEnv servers or verifiers packages plug in the same way): its `name` (what errors call it), its tools' schemas,
whether it has `step` and `reward`, and `open(pool)`, which gives a fresh `EnvBackend` for one session. A backend
has one method, `call(method, args, kwargs, timeout=, fresh=, offered=)` -> a Future of the result (plus `close()`):
a class environment's is an `ObjectHost` (a worker process holding the instance; the Future fails with
`TimeoutError` past the limit, `pebble.ProcessExpired` when the worker died, `HostCallError` when the method
raised, `HostLost` when the instance is gone); another kind maps the same calls to its own transport
(a WebSocket's reset/step messages, say) and fails the same ways.

`EnvSession` (`spec.make(timeout_s, pool)`) is one trajectory's environment over its backend; it does what is the
same for every kind: `reset(record)` (a fresh instance, its first messages), `step_future(text)` (the model's turn
in, `StepResult` out), `tools` (the environment's methods as tools with a `runner` into the backend), and
`reward_future(messages, record)` (its final `reward(...)`, given those of `messages`, `completion`, `record` and
`turn_rewards` that it names); it checks what comes back, sums the per-turn rewards, keeps the first failure, and
closes the backend (`close()`; at once when a timeout or crash lost the instance). Every call has the session's time
limit (None: none). A call that times out, crashes its worker, raises or returns the wrong type is an
`EnvFailure` (method, kind, one line naming the class): `reset` raises it as `EnvCallError`, `step` and the reward
return its text; none of them ever raises anything else or blocks the trainer past the limit, since the user's code
runs in another process (a method holding the interpreter lock, ignoring signals or calling `os._exit` is killed or
noticed there).

Per-turn rewards (from `step`) are summed, undiscounted, and the final `reward(...)` is added:
`trajectory_reward` gives the one number per trajectory that group advantages use.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import pebble

from posttrain.tools import Tool
from posttrain.tools.hosting import HostCallError, HostLost
from posttrain.tools.in_process import as_text

__all__ = ["EnvBackend", "EnvCallError", "EnvFailure", "EnvironmentSpec", "EnvSession", "StepResult",
           "trajectory_reward"]

#: `EnvFailure.kind` values: the call ran past its time limit, ended its worker (or lost the instance), raised,
#: or returned the wrong type.
FAILURE_KINDS = ("timeout", "crash", "exception", "bad_type")


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


class EnvBackend(Protocol):
    """Where one session's calls go (see the module docstring)."""

    def call(self, method: str, args: tuple = (), kwargs: dict | None = None, *, timeout: float | None,
             fresh: bool = False, offered: bool = False) -> cf.Future: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EnvironmentSpec:
    """A loaded environment: its name and reference, the schemas of its tool methods, what it defines, and how to
    open a backend for one session (`open(pool)`: `pool` is the run's `ToolPool`, whose worker machinery a class
    environment's backend uses)."""
    name: str
    ref: str
    tool_names: tuple[str, ...]
    schemas: tuple[dict, ...]
    has_step: bool
    has_reward: bool
    open: Callable[[Any], EnvBackend]

    def make(self, timeout_s: float | None = None, pool=None) -> "EnvSession":
        """A fresh session for one trajectory, its calls limited to `timeout_s` seconds each (None: no limit), its
        backend opened on `pool` (default: the process-wide tool pool)."""
        if pool is None:
            from posttrain.tools.execution import default_pool  # lazy: only callers without a run's pool
            pool = default_pool()
        return EnvSession(self, timeout_s, lambda: self.open(pool))


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


def _then(fut: cf.Future, fn: Callable[[cf.Future], Any]) -> cf.Future:
    """A Future of `fn(fut)` once `fut` is done (`fn` must not raise)."""
    out: cf.Future = cf.Future()
    fut.add_done_callback(lambda f: out.set_result(fn(f)))
    return out


class EnvSession:
    """One trajectory's environment over its backend: first failure (`failure`), per-turn rewards, tools (see the
    module docstring)."""

    def __init__(self, spec: EnvironmentSpec, timeout_s: float | None, open_backend: Callable[[], EnvBackend]):
        self.spec, self.timeout_s, self._open = spec, timeout_s, open_backend
        self.backend: EnvBackend | None = None  # opened by `reset` (again after a close: a session can be reused)
        self.turn_rewards: list[float] = []
        self.failure: EnvFailure | None = None
        self._lock = threading.Lock()
        self.tools: dict[str, Tool] = {
            schema["function"]["name"]: Tool(name=schema["function"]["name"], schema=schema, fn=_remote_only,
                                             runner=self._runner(attr))
            for attr, schema in zip(spec.tool_names, spec.schemas)}

    @property
    def name(self) -> str:
        return self.spec.name

    def fail(self, method: str, kind: str, text: str) -> EnvFailure:
        """Records a failure (the session keeps the first) and returns it; a timeout or crash (the instance is
        gone) closes the backend at once."""
        failure = EnvFailure(method, kind, _one_line(text))
        with self._lock:
            self.failure = self.failure or failure
        if kind in ("timeout", "crash"):
            self.close()
        return failure

    def failed(self, method: str, e: BaseException) -> EnvFailure:
        """Records the failure of a call to `method` that ended with `e`."""
        where = f"{self.name}.{method}"
        if isinstance(e, TimeoutError):
            return self.fail(method, "timeout", f"{where} ran past its {self.timeout_s:g}s time limit (its worker "
                                                "process was killed)")
        if isinstance(e, pebble.ProcessExpired):
            return self.fail(method, "crash", f"{where} ended its worker process (exit code {e.exitcode})")
        if isinstance(e, HostLost):
            return self.fail(method, "crash", f"{where}: {e}")
        if isinstance(e, _BadType):
            return self.fail(method, "bad_type", str(e))
        if isinstance(e, HostCallError):
            return self.fail(method, "exception", f"{where} failed: {e}")
        return self.fail(method, "exception", f"{where} failed: {type(e).__name__}: {e}")

    def _call(self, method: str, args: tuple = (), kwargs: dict | None = None, timeout: float | None = None,
              **how) -> cf.Future:
        backend = self.backend
        if backend is None:
            out: cf.Future = cf.Future()
            out.set_exception(HostLost("the session is closed (reset opens it)"))
            return out
        return backend.call(method, args, kwargs, timeout=self.timeout_s if timeout is None else timeout, **how)

    # ------------------------------------------------------------------ reset
    def reset_future(self, record: dict) -> cf.Future:
        """A Future of the first messages of a fresh instance for `record`, or of None when construction or `reset`
        timed out, crashed, raised or returned junk (then `failure` says what). Never fails. A session may be reset
        again (a new episode: its rewards and failure start afresh)."""
        with self._lock:
            self.turn_rewards, self.failure = [], None
            if self.backend is None:
                self.backend = self._open()

        def done(f: cf.Future) -> list[dict] | None:
            try:
                return _check_messages(f.result(), self.name)
            except BaseException as e:  # noqa: BLE001 - every way the user's code fails, as one line
                self.failed("reset", e)
                return None

        return _then(self._call("reset", (record,), fresh=True), done)

    def reset(self, record: dict) -> list[dict]:
        """`reset_future(record)`, waited for; raises `EnvCallError` (one line naming the class) when it failed."""
        messages = self.reset_future(record).result()
        if messages is None:
            raise EnvCallError(self.failure)
        return messages

    # ------------------------------------------------------------------ step
    def step_future(self, text: str) -> cf.Future:
        """A Future of the environment's `StepResult` for the model's turn `text` (never blocks; a timed-out,
        crashed, raising or ill-typed `step` gives a result with `error`, done)."""
        def done(f: cf.Future) -> StepResult:
            try:
                res = _check_step(f.result(), self.name)
            except BaseException as e:  # noqa: BLE001
                return StepResult(None, 0.0, True, self.failed("step", e).text)
            self.turn_rewards.append(res.reward)
            return res

        return _then(self._call("step", (text,)), done)

    def step(self, text: str) -> StepResult:
        """`step_future(text)`, waited for."""
        return self.step_future(text).result()

    # ------------------------------------------------------------------ tools
    def _runner(self, method: str) -> Callable[[dict, float | None], cf.Future]:
        """A tool `runner` for `method`: the backend's call as `(status, text, seconds)`; a raising method is a tool
        error (`exception`), its time-outs and crashes fail the Future (the tool pool reports them, and the
        trajectory records the session's failure)."""
        def run(arguments: dict, timeout: float | None) -> cf.Future:
            start = time.perf_counter()
            out: cf.Future = cf.Future()

            def done(f: cf.Future) -> None:
                try:
                    out.set_result(("ok", as_text(f.result()), time.perf_counter() - start))
                except HostCallError as e:
                    out.set_result(("exception", str(e), time.perf_counter() - start))
                except BaseException as e:  # noqa: BLE001 - TimeoutError, ProcessExpired, HostLost: the pool's
                    out.set_exception(e)

            self._call(method, (), arguments, timeout=timeout).add_done_callback(done)
            return out

        return run

    # ------------------------------------------------------------------ the finished trajectory
    def reward_future(self, messages: Sequence[dict], record: dict | None = None) -> cf.Future:
        """A Future of `(reward, error)` from the environment's `reward(...)`: `(None, None)` when it has none."""
        out: cf.Future = cf.Future()
        if not self.spec.has_reward:
            out.set_result((None, None))
            return out
        completion = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        offered = {"messages": list(messages), "completion": completion, "record": record,
                   "turn_rewards": list(self.turn_rewards)}

        def done(f: cf.Future) -> tuple[float | None, str | None]:
            try:
                return _check_number(f.result(), f"{self.name}.reward"), None
            except BaseException as e:  # noqa: BLE001
                return None, self.failed("reward", e).text

        return _then(self._call("reward", (), offered, offered=True), done)

    def final_reward(self, messages: Sequence[dict], record: dict | None = None) -> tuple[float | None, str | None]:
        """`reward_future(messages, record)`, waited for."""
        return self.reward_future(messages, record).result()

    def close(self) -> None:
        """Close the backend (the worker holding the instance ends); later calls fail as lost, until a `reset`."""
        with self._lock:
            backend, self.backend = self.backend, None
        if backend is not None:
            backend.close()


def _remote_only(**_):
    raise RuntimeError("an environment's method runs in its session's worker (Tool.runner), not here")


def trajectory_reward(turn_rewards: Sequence[float], final: float | None) -> float:
    """One number per trajectory: the per-turn rewards summed (undiscounted) plus the final reward."""
    return float(sum(turn_rewards)) + (0.0 if final is None else float(final))
