"""Running one tool call and turning its outcome into a tool message for the model and a record for metrics.

`run_tool_call(tools, call, timeout=..., max_output_chars=...)` -> `(message, record)`: `message` is
`{"role": "tool", "name": ..., "content": ...}` (plus `tool_call_id` when the call had an id), its content
the tool's result as text (non-strings as JSON), cut at `max_output_chars` with a marker; any problem (an
unknown tool, arguments that do not fit the schema, an exception, a time limit, a crashed worker) gives the
content `{"error": "..."}` instead and never raises. `record` is a `ToolRecord(name, seconds, error)` where
`error` is None or one of `ERROR_KINDS`.

Tools loaded from a reference run in a `ToolPool`: pebble worker processes that load the tool by its
reference, so a tool that hangs is killed at `timeout` (its worker is replaced) and one whose process dies
(a crash, or an exit with any status) fails only its own call, at once; calls `submit`ted together run
concurrently, one per worker. What a tool prints is captured and dropped (bounded). The built-in `python` tool's
limit is not `timeout` but its sandbox's `call_limit_s` (its own wall limit plus start-up slack, so the sandbox
always cleans up before the pool would kill it). Workers sweep the leftovers of killed calls when they start
(`python_sandbox.sweep_leftovers`) and die at once on SIGTERM.

An environment's methods run in `ObjectHost`s the pool makes (`host(ref)`: one worker process per trajectory,
holding its instance; `posttrain.tools.hosting`), as tools with a `runner` that calls into that worker; a call past
`timeout` kills the worker (the instance is lost). Tools in hand without a reference or a runner (a plain function
given to the API) run in the calling process in a daemon thread, abandoned past `timeout` (posttrain.tools.in_process).
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import io
import json
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import pebble

from posttrain.tools.hosting import ObjectHost
from posttrain.tools.in_process import as_text, call_plain, settle_within
from posttrain.tools.loading import Tool, resolve_tool
from posttrain.tools.python_sandbox import SandboxConfig, python, sweep_leftovers, use_sandbox
from posttrain.workers import StrictProcessPool, pool_context, preload, process_start_time, watch_owner

__all__ = ["ERROR_KINDS", "ToolCall", "ToolPool", "ToolRecord", "cut_text", "error_content", "run_tool_call",
           "tool_message"]

#: `ToolRecord.error` values: no such tool, arguments not matching the schema, the tool raised, ran past its
#: time limit, its process died; `parse` is for calls the parser could not read (see posttrain.agent.parsers).
ERROR_KINDS = ("unknown_tool", "bad_arguments", "exception", "timeout", "crash", "parse")

preload("posttrain.tools.execution")  # tool and environment workers start from a fork server that has it


@dataclass(frozen=True)
class ToolCall:
    """A call the model asked for: the tool's name and its arguments (and the call's id, if the format has one)."""
    name: str
    arguments: dict = field(default_factory=dict)
    id: str | None = None


@dataclass(frozen=True)
class ToolRecord:
    """What metrics count about one call: its tool, how long it took, and its error kind (None: it worked)."""
    name: str
    seconds: float
    error: str | None = None


def tool_message(name: str, content: str, call_id: str | None = None) -> dict:
    msg = {"role": "tool", "name": name, "content": content}
    if call_id is not None:
        msg["tool_call_id"] = call_id
    return msg


def error_content(text: str) -> str:
    return json.dumps({"error": text}, ensure_ascii=False)


def cut_text(text: str, max_chars: int) -> str:
    """`text`, or its first `max_chars` characters and a marker saying how much was cut."""
    if max_chars is None or len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[... output cut: {len(text) - max_chars} more characters]"


def _check_arguments(tool: Tool, arguments: Any) -> str | None:
    if not isinstance(arguments, Mapping):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    params = tool.schema["function"].get("parameters", {})
    known = set(params.get("properties", {}))
    unknown = sorted(set(arguments) - known)
    missing = [p for p in params.get("required", []) if p not in arguments]
    if unknown or missing:
        return (f"tool {tool.name!r} takes {sorted(known)}" + (f"; unknown: {unknown}" if unknown else "")
                + (f"; missing: {missing}" if missing else ""))
    return None


class _Sink(io.TextIOBase):
    """A stdout/stderr stand-in that keeps nothing (a tool's prints must not flood the run's logs)."""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        return len(s)


def call_tool(fn, arguments: dict) -> tuple[str, str, float]:
    """`fn(**arguments)` as `(status, text, seconds)`: status `ok` or `exception`; never raises."""
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(_Sink()), contextlib.redirect_stderr(_Sink()):
            out = fn(**arguments)
        return "ok", as_text(out), time.perf_counter() - start
    except BaseException as e:  # noqa: BLE001 - a tool must never take its caller down
        return "exception", f"{type(e).__name__}: {e}", time.perf_counter() - start


_WORKER_TOOLS: dict[str, Any] = {}


def _worker_call(ref: str, arguments: dict) -> tuple[str, str, float]:
    if ref not in _WORKER_TOOLS:
        try:
            _WORKER_TOOLS[ref] = resolve_tool(ref)
        except Exception as e:
            return "exception", f"cannot load tool: {e}", 0.0
    return call_tool(_WORKER_TOOLS[ref], arguments)


def _worker_init(owner: int, owner_start: str | None, sandbox: SandboxConfig) -> None:
    """Workers end themselves once the process that owns the pool is gone (even after SIGKILL), die at once on
    SIGTERM (pebble's stop: a call holding the interpreter lock would otherwise wait 3 s for SIGKILL), remove what
    killed calls left behind, and run the python tool with the run's sandbox setting."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    watch_owner(owner, owner_start)
    sweep_leftovers()
    use_sandbox(sandbox)


def _ping() -> int:
    return os.getpid()


class ToolPool:
    """`num_workers` processes running tool calls (started lazily, replaced when killed or crashed); a worker
    that exits during a call, with any status, fails that call at once as a `crash`. `sandbox`: how the
    built-in python tool runs code in the workers (and in environments' workers, `host`)."""

    def __init__(self, num_workers: int = 4, mp_context: str | None = None,
                 sandbox: SandboxConfig = SandboxConfig()):
        self.num_workers = num_workers
        self.sandbox = sandbox
        use_sandbox(sandbox)
        self.mp_context = mp_context or ("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                         else "spawn")
        self._pool: StrictProcessPool | None = None
        self._lock = threading.Lock()

    def _initargs(self) -> tuple:
        owner = os.getpid()
        return owner, process_start_time(owner), self.sandbox

    def _active(self) -> StrictProcessPool:
        with self._lock:
            if self._pool is None or not self._pool.active:
                self._pool = StrictProcessPool(max_workers=self.num_workers, initializer=_worker_init,
                                               initargs=self._initargs(), context=pool_context(self.mp_context))
            return self._pool

    def host(self, ref: str) -> ObjectHost:
        """A worker process of its own holding one object of the class `ref` names (an environment's instance),
        started like this pool's workers (same context, owner watch, sandbox setting); the caller closes it."""
        return ObjectHost(ref, context=pool_context(self.mp_context), initializer=_worker_init,
                          initargs=self._initargs())

    def time_limit(self, tool: Tool, timeout: float | None) -> float | None:
        """The pool's limit for a call of `tool`: `timeout`, but for the built-in python tool its sandbox's
        `call_limit_s` (the sandbox's own wall limit ends first and cleans up)."""
        return self.sandbox.call_limit_s if tool.fn is python else timeout

    def submit(self, tools: Mapping[str, Tool], call: ToolCall, *, timeout: float | None,
               max_output_chars: int | None) -> cf.Future:
        """A future of `(message, record)` for `call` (see `run_tool_call`)."""
        out: cf.Future = cf.Future()
        tool = tools.get(call.name)
        problem = _problem(tools, tool, call)
        if problem is not None:
            out.set_result(problem)
        elif tool.runner is not None:  # an environment's method, in the worker holding its instance
            start = time.perf_counter()
            fut = tool.runner(dict(call.arguments), timeout)
            fut.add_done_callback(lambda f: out.set_result(_outcome(f, call, start, timeout, max_output_chars)))
        elif tool.in_process:  # a callable in hand: a daemon thread, given up on past `timeout` (a thread cannot
            # be killed: it is abandoned; posttrain.tools.in_process)
            settle_within(out, timeout,
                          lambda: _finish(call, *call_plain(tool.fn, dict(call.arguments)), max_output_chars),
                          lambda: _failure(call, "timeout", f"tool {call.name!r} ran past its {timeout:g}s time limit "
                                           "(its thread was abandoned)", float(timeout)), name=f"tool-{call.name}")
        else:
            start = time.perf_counter()
            timeout = self.time_limit(tool, timeout)
            try:
                fut = self._active().schedule(_worker_call, args=(tool.ref, dict(call.arguments)), timeout=timeout)
            except Exception as e:  # the pool broke while scheduling
                out.set_result(_failure(call, "crash", f"tool worker pool failed: {e}", 0.0))
                return out
            fut.add_done_callback(lambda f: out.set_result(_outcome(f, call, start, timeout, max_output_chars)))
        return out

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()


def _failure(call: ToolCall, kind: str, text: str, seconds: float) -> tuple[dict, ToolRecord]:
    return tool_message(call.name, error_content(text), call.id), ToolRecord(call.name, seconds, kind)


def _problem(tools, tool, call) -> tuple[dict, ToolRecord] | None:
    if tool is None:
        return _failure(call, "unknown_tool", f"unknown tool {call.name!r}; available: {sorted(tools)}", 0.0)
    bad = _check_arguments(tool, call.arguments)
    return None if bad is None else _failure(call, "bad_arguments", bad, 0.0)


def _finish(call: ToolCall, status: str, text: str, seconds: float, max_chars: int | None):
    if status != "ok":
        return _failure(call, "exception", cut_text(text, max_chars), seconds)
    return tool_message(call.name, cut_text(text, max_chars), call.id), ToolRecord(call.name, seconds, None)


def _outcome(fut, call: ToolCall, start: float, timeout: float | None, max_chars: int | None):
    try:
        return _finish(call, *fut.result(), max_chars)
    except TimeoutError:
        return _failure(call, "timeout", f"tool {call.name!r} ran past its {timeout:g}s time limit and was stopped",
                        float(timeout))
    except pebble.ProcessExpired as e:
        return _failure(call, "crash", f"tool {call.name!r} ended its process during the call (exit code {e.exitcode})",
                        time.perf_counter() - start)
    except BaseException as e:  # noqa: BLE001 - unpicklable arguments or results, a broken pool
        return _failure(call, "crash", f"tool {call.name!r} failed: {type(e).__name__}: {e}",
                        time.perf_counter() - start)


_DEFAULT_POOL: ToolPool | None = None


def default_pool() -> ToolPool:
    """The process-wide pool `run_tool_call` uses when given none (closed at exit)."""
    global _DEFAULT_POOL
    if _DEFAULT_POOL is None:
        _DEFAULT_POOL = ToolPool()
        atexit.register(_DEFAULT_POOL.close)
    return _DEFAULT_POOL


def run_tool_call(tools: Mapping[str, Tool], call: ToolCall, *, timeout: float | None, max_output_chars: int | None,
                  pool: ToolPool | None = None) -> tuple[dict, ToolRecord]:
    """Run `call` and wait for it: `(tool message, ToolRecord)`; never raises (see the module docstring)."""
    return (pool or default_pool()).submit(tools, call, timeout=timeout, max_output_chars=max_output_chars).result()
