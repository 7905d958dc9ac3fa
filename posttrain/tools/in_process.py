"""Calls that must run in the caller's own process (an environment's `reset`, `step`, `reward` and tool methods,
where a trajectory's state lives), with a time limit.

The call runs in a fresh daemon thread and the caller stops waiting at the limit. A Python thread cannot be
killed: a call past its limit is **abandoned**, still running; being a daemon it never holds up the process's
exit, but whatever it does later (to the environment instance it was given, say) is never looked at again, so
the caller must treat that instance as lost. `settle_within` fills a `Future` (for callers that must not block:
the sampler's turn-end callbacks), `call_within` waits; `call_plain` runs a tool method like the worker pool's
`call_tool` but without swapping `sys.stdout` (a swap is process-wide: an abandoned thread would keep the run's
own output in the sink).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
from typing import Any, Callable

__all__ = ["DeadlineExceeded", "as_text", "call_plain", "call_within", "settle_within"]


class DeadlineExceeded(TimeoutError):
    """An in-process call ran past its time limit (its thread is abandoned, still running)."""


def settle_within(out: cf.Future, timeout: float | None, work: Callable[[], Any], on_timeout: Callable[[], Any],
                  name: str = "posttrain-in-process") -> cf.Future:
    """Completes `out` with `work()`'s result (or exception) if it returns within `timeout` seconds, else with
    `on_timeout()`'s (or its exception); whichever comes first wins. Never blocks. `timeout` None: no limit."""
    lock, claimed = threading.Lock(), [False]

    def settle(compute: Callable[[], Any]) -> None:
        try:
            value, error = compute(), None
        except BaseException as e:  # noqa: BLE001 - handed to the Future's owner
            value, error = None, e
        with lock:
            if claimed[0]:
                return
            claimed[0] = True
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(value)

    threading.Thread(target=settle, args=(work,), daemon=True, name=name).start()
    if timeout is not None:
        timer = threading.Timer(float(timeout), settle, args=(on_timeout,))
        timer.daemon = True
        timer.start()
        out.add_done_callback(lambda _: timer.cancel())
    return out


def call_within(fn: Callable[..., Any], timeout: float | None, *args, name: str = "posttrain-in-process") -> Any:
    """`fn(*args)` in a daemon thread, waited for at most `timeout` seconds (None: no limit): its result or its
    exception, or `DeadlineExceeded` (the thread is then abandoned)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e
        done.set()

    threading.Thread(target=run, daemon=True, name=name).start()
    if not done.wait(timeout):
        raise DeadlineExceeded(f"ran past its {timeout:g}s time limit")
    if "error" in box:
        raise box["error"]
    return box["value"]


def as_text(value: Any) -> str:
    """A tool's result as text: strings as they are, anything else as JSON (or `str` when not JSON-able)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def call_plain(fn: Callable[..., Any], arguments: dict) -> tuple[str, str, float]:
    """`fn(**arguments)` as `(status, text, seconds)` (status `ok` or `exception`, as `call_tool`); never raises."""
    start = time.perf_counter()
    try:
        return "ok", as_text(fn(**arguments)), time.perf_counter() - start
    except BaseException as e:  # noqa: BLE001 - a tool must never take its caller down
        return "exception", f"{type(e).__name__}: {e}", time.perf_counter() - start
