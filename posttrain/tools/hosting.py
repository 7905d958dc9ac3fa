"""One user object (an environment's instance) in a worker process of its own, its methods called with time limits.

`ObjectHost(ref, ...)` is a one-worker `StrictProcessPool` (the tool pool's machinery: `ToolPool.host` makes one
with the tool workers' initializer) whose worker holds one object of the class `ref` names between calls, so state
survives from call to call. `call(method, args, kwargs, timeout=..., fresh=True)` -> a Future of the method's return
value (`fresh`: a new instance is made first, `cls()`); calls run one at a time, in order. The Future fails with
- `HostCallError` when the method (or the constructor) raised: its type and message, one line; the object lives on;
- `TimeoutError` past `timeout` (the worker is killed: a method stuck in C code, holding the interpreter lock, or
  ignoring signals, is stopped all the same), `pebble.ProcessExpired` when the worker died (a crash, `os._exit`),
  `HostLost` when a call reaches a replacement worker that holds no object: in all three the object is gone.
The worker is never replaced: once it is gone, so is the object, and the owner closes the host. `close()` stops
the worker without waiting (a background thread joins it; `wait_closed()` waits for that) and fails the calls
still waiting with `HostLost`. Costs a process per host (started from the fork server, the user's module imported
in it on the first call) and a round trip per call: measured in docs/explanation/security.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import os
import queue
import threading
from typing import Any

from posttrain.loading import load_callable
from posttrain.workers import StrictProcessPool

__all__ = ["HostCallError", "HostLost", "ObjectHost", "wait_closed"]


class HostCallError(RuntimeError):
    """The hosted method raised; `type_name` and the one-line `message` say what."""

    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.type_name, self.message = type_name, message


class HostLost(RuntimeError):
    """The call reached a worker that holds no object (its first worker was killed or died)."""


# ---------------------------------------------------------------------- worker side
_HELD: dict[str, Any] = {}


def _kwargs_for(fn, kwargs: dict) -> dict:
    """Those of `kwargs` that `fn` names (all of them if it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _hosted_call(ref: str, method: str, args: tuple, kwargs: dict, fresh: bool, offered: bool):
    """In the worker: `("ok", value)` or `("error", type name, message)`; `("lost",)` without an object."""
    try:
        if fresh:
            _HELD.pop("object", None)
            _HELD["object"] = load_callable(ref, what="environment")()
        if "object" not in _HELD:
            return ("lost",)
        fn = getattr(_HELD["object"], method)
        return ("ok", fn(*args, **(_kwargs_for(fn, kwargs) if offered else kwargs)))
    except BaseException as e:  # noqa: BLE001 - user code: sys.exit() in it fails the call, not the worker
        return ("error", type(e).__name__, " ".join(str(e).split()))


# ---------------------------------------------------------------------- caller side
_CLOSING: queue.Queue = queue.Queue()
_CLOSER: list[threading.Thread] = []
_STATE = threading.Condition()
_PENDING = [0]  # pools handed to the closer and not yet joined


def _closer() -> None:
    while True:
        pool = _CLOSING.get()
        try:
            pool.join()
        except Exception:  # noqa: BLE001 - a pool that cannot be joined is left to the owner watch
            pass
        with _STATE:
            _PENDING[0] -= 1
            _STATE.notify_all()


def _close_later(pool: StrictProcessPool) -> None:
    pool.stop()
    with _STATE:
        _PENDING[0] += 1
        if not _CLOSER:
            _CLOSER.append(threading.Thread(target=_closer, daemon=True, name="object-host-closer"))
            _CLOSER[0].start()
    _CLOSING.put(pool)


def wait_closed(timeout: float | None = 10.0) -> bool:
    """Wait until every closed host's worker is gone (True), at most `timeout` seconds."""
    with _STATE:
        return _STATE.wait_for(lambda: _PENDING[0] == 0, timeout)


def _settle(out: cf.Future, fut: cf.Future) -> None:
    if out.done():  # failed by `close` already
        return
    try:
        answer = fut.result()
    except BaseException as e:  # noqa: BLE001 - TimeoutError, ProcessExpired, pickling problems: the caller's
        _set(out, exception=e)
        return
    if answer[0] == "ok":
        _set(out, result=answer[1])
    elif answer[0] == "lost":
        _set(out, exception=HostLost("the object is gone (its worker process was replaced after a failure)"))
    else:
        _set(out, exception=HostCallError(answer[1], answer[2]))


def _set(out: cf.Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Complete `out` unless something else did first (`close` and the pool race)."""
    try:
        if exception is not None:
            out.set_exception(exception)
        else:
            out.set_result(result)
    except cf.InvalidStateError:
        pass


_STARTER = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="object-host-start")


def _ping() -> int:
    return os.getpid()


class ObjectHost:
    """A worker process holding one object of the class `ref` names (see the module docstring). Its worker is
    started in a background thread (a process start takes milliseconds the caller, often the sampler's thread,
    should not wait for): calls made before it is up are queued, and all are scheduled in the order made."""

    def __init__(self, ref: str, *, context, initializer=None, initargs: tuple = ()):
        self.ref = ref
        self._lock = threading.Lock()
        self._waiting: set[cf.Future] = set()
        self._queued: list[tuple[cf.Future, tuple, float | None]] = []  # calls made before the worker started
        self._started = False
        self._pool: StrictProcessPool | None = StrictProcessPool(max_workers=1, initializer=initializer,
                                                                 initargs=initargs, context=context, respawn=False)
        _STARTER.submit(self._start)

    def _start(self) -> None:
        """Start the worker (scheduling a ping starts pebble's pool), then the calls queued meanwhile, in order."""
        pool = self._pool
        try:
            if pool is not None:
                pool.schedule(_ping)
        except Exception:  # noqa: BLE001 - closed meanwhile, or it broke: the queued calls fail below
            pass
        while True:
            with self._lock:
                if not self._queued:
                    self._started = True
                    return
                out, args, timeout = self._queued.pop(0)
            self._schedule(out, args, timeout)

    def call(self, method: str, args: tuple = (), kwargs: dict | None = None, *, timeout: float | None,
             fresh: bool = False, offered: bool = False) -> cf.Future:
        """A Future of `object.method(*args, **kwargs)` (`fresh`: on a new object; `offered`: only the keyword
        arguments the method names). Never raises or blocks; see the module docstring for how it fails."""
        out: cf.Future = cf.Future()
        call = (self.ref, method, tuple(args), dict(kwargs or {}), fresh, offered)
        with self._lock:
            closed = self._pool is None
            if not closed:
                self._waiting.add(out)
                if not self._started:
                    self._queued.append((out, call, timeout))
                    return out
        if closed:
            out.set_exception(HostLost("the host was closed (its object is gone)"))
            return out
        self._schedule(out, call, timeout)
        return out

    def _schedule(self, out: cf.Future, call: tuple, timeout: float | None) -> None:
        out.add_done_callback(self._forget)
        pool = self._pool
        try:
            if pool is None:
                raise HostLost("the host was closed (its object is gone)")
            fut = pool.schedule(_hosted_call, args=call, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - closed meanwhile, or the pool broke
            _set(out, exception=e if isinstance(e, HostLost) else HostLost(f"the host's worker pool failed: {e}"))
            return
        fut.add_done_callback(lambda f: _settle(out, f))

    def _forget(self, out: cf.Future) -> None:
        with self._lock:
            self._waiting.discard(out)

    def close(self) -> None:
        """Stop the worker now (the pool is joined in the background: `wait_closed`); calls still waiting fail
        with `HostLost`."""
        with self._lock:
            pool, self._pool = self._pool, None
            waiting, self._waiting = list(self._waiting), set()
        if pool is None:
            return
        _close_later(pool)
        for out in waiting:
            _set(out, exception=HostLost("the host was closed during the call (its object is gone)"))
