"""Calls of a tool in hand (a plain function given to the API, without a reference a worker could load it by) in
the caller's own process, with a time limit; and `as_text`, a tool result as text.

The call runs in a fresh daemon thread and the caller stops waiting at the limit. A Python thread cannot be
killed: a call past its limit is **abandoned**, still running; being a daemon it never holds up the process's
exit. (Tools loaded by reference and environments' methods run in worker processes instead, where a call past
its limit is killed: posttrain.tools.execution.) `settle_within` fills a `Future` (for callers that must not
block: the sampler's turn-end callbacks); `call_plain` runs a tool like the worker pool's `call_tool` but without
swapping `sys.stdout` (a swap is process-wide: an abandoned thread would keep the run's own output in the sink).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
from typing import Any, Callable

__all__ = ["as_text", "call_plain", "settle_within"]


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
