"""Running reward calls in worker processes: per-call time limits, and a failure is one failed call.

`run_chunk` is one reward call on one chunk of completions; it never raises and turns every problem into a
status (`ok`, `error`, `timeout`, `bad_length`). Inside a worker the call runs under ``signal.setitimer``
(a soft limit that interrupts Python code, so the worker survives). `RewardPool` runs calls in a pebble
`ProcessPool`, which knows which worker runs which call: a call still running ``hard_timeout_s`` after it
started (a reward that ignores the soft limit, or hangs in C code) has its worker killed and is reported as
a timeout, a worker that dies (segfault, ``os._exit`` with any status) fails only the call it was running, at
once (`posttrain.workers.StrictProcessPool`), and the pool replaces the worker and goes on. Workers end
themselves within about a second once the process that created the pool is gone, even after SIGKILL.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import math
import numbers
import os
import pickle
import signal
import threading
import traceback
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

import numpy as np
import pebble

from posttrain.rewards.loading import resolve_reward
from posttrain.workers import StrictProcessPool, pool_context, preload, process_start_time, watch_owner

__all__ = ["RewardPool", "run_chunk"]

preload("__main__", "posttrain.rewards.pool", "math_verify")


class _SoftTimeout(BaseException):
    """Raised by SIGALRM inside a reward call (BaseException so ``except Exception`` can't eat it)."""


@contextlib.contextmanager
def _soft_time_limit(seconds: float | None):
    usable = (
        seconds is not None
        and seconds > 0
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def _raise(signum, frame):
        raise _SoftTimeout()

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_WORKER_CACHE: dict[Any, Callable] = {}


def _worker_resolve(ref, kwargs):
    if not isinstance(ref, str):
        return resolve_reward(ref, kwargs)
    key = (ref, pickle.dumps(kwargs))
    if key not in _WORKER_CACHE:
        _WORKER_CACHE[key] = resolve_reward(ref, kwargs)
    return _WORKER_CACHE[key]


def _as_number(v: Any) -> float | None:
    if isinstance(v, np.ndarray) and v.ndim == 0:
        v = v.item()
    if isinstance(v, (str, bytes)) or not isinstance(v, (numbers.Real, np.bool_)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def run_chunk(ref, kwargs, prompts, completions, fields, timeout_s):
    """Run one reward on one chunk. Returns ``(status, values, message)``; never raises.

    status: ``ok`` (values: list of float or None for NaN/inf/non-numbers), ``error``,
    ``timeout`` or ``bad_length`` (values None).
    """
    try:
        fn = _worker_resolve(ref, kwargs)
    except Exception as e:
        return ("error", None, " ".join(f"cannot load reward: {type(e).__name__}: {e}".split()))
    try:
        with _soft_time_limit(timeout_s):
            out = fn(list(prompts), list(completions), **fields)
    except _SoftTimeout:
        return ("timeout", None, f"call exceeded the {timeout_s}s time limit")
    except BaseException as e:  # noqa: BLE001 - a reward must never take the worker down
        # one line: the error and where the reward raised it; POSTTRAIN_DEBUG=1 adds the traceback's end
        frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        text = " ".join(f"{type(e).__name__}: {e}".split())
        if frame is not None:
            text += f" ({os.path.basename(frame.filename)}:{frame.lineno}, in {frame.name})"
        if os.environ.get("POSTTRAIN_DEBUG", "") not in ("", "0"):
            tb = traceback.format_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
            text += "\n" + "".join(tb[-3:])
        return ("error", None, text)
    n = len(completions)
    if isinstance(out, np.ndarray):
        out = out.reshape(-1).tolist() if out.ndim <= 1 else None
    try:
        values = list(out)
    except TypeError:
        return ("error", None, f"returned {type(out).__name__}, expected a list of {n} numbers")
    if len(values) != n:
        return ("bad_length", None, f"returned {len(values)} values for {n} completions")
    clean = [_as_number(v) for v in values]
    bad = sum(v is None for v in clean)
    return ("ok", clean, f"{bad} value(s) were NaN/inf or not numbers" if bad else None)


# ---------------------------------------------------------------------- worker side
def _worker_init(owner_pid: int, owner_start: str | None, interval_s: float = 1.0):
    watch_owner(owner_pid, owner_start, interval_s)
    with contextlib.suppress(Exception):
        # lazy: pre-imported in each reward worker only, so that its first math_answer call is fast
        import math_verify  # noqa: F401


def _ping():
    return os.getpid()


# ---------------------------------------------------------------------- the pool
class RewardPool:
    """`num_workers` reward processes (started here, checked with a ping) running `run_chunk` calls.

    ``mp_context``: ``"forkserver"`` (default where available: the reward stack is imported once in the
    fork server, so a replaced worker starts in milliseconds) or ``"spawn"``. ``hard_timeout_s``: seconds a
    call may run before its worker is killed (None: unlimited)."""

    def __init__(self, num_workers: int, mp_context: str, hard_timeout_s: float | None):
        self.num_workers, self.mp_context, self.hard_timeout_s = num_workers, mp_context, hard_timeout_s
        self._pool: StrictProcessPool | None = None
        self._start()

    def _start(self) -> None:
        ctx = pool_context(self.mp_context)  # (the fork server preloads the reward stack: below)
        owner = os.getpid()
        self._pool = StrictProcessPool(max_workers=self.num_workers, initializer=_worker_init,
                                       initargs=(owner, process_start_time(owner)), context=ctx)
        try:
            warm = [self._pool.schedule(_ping) for _ in range(self.num_workers)]
            done, not_done = cf.wait(warm, timeout=120)
            problem = next((f.exception() for f in done if f.exception() is not None), None)
            if not_done:
                problem = TimeoutError("no answer within 120 s")
        except Exception as e:
            problem = e
        if problem is not None:
            self.close(grace_s=0.0)
            raise RuntimeError(
                f"reward worker processes ({self.mp_context}) failed to start: {type(problem).__name__}: {problem}. "
                "The main module must be importable (not stdin); or use num_workers=0."
            ) from problem

    def run(self, calls: list[tuple]) -> list[tuple]:
        """`run_chunk(*call)` for every call, in order; a call that outlives ``hard_timeout_s`` or whose
        worker dies gets a `timeout` / `error` status. Calls lost to the pool breaking as a whole (a worker
        that died before its call was known to have started) run once more on a fresh pool."""
        out = self._submit(calls)
        again = [k for k, r in enumerate(out) if r is None]
        for k, r in zip(again, self._submit([calls[k] for k in again]) if again else ()):
            out[k] = r or ("error", None, "reward worker pool broke twice while running this call")
        return out

    def _submit(self, calls: list[tuple]) -> list[tuple | None]:
        if self._pool is None or not self._pool.active:  # closed, or broken as a whole: a new one
            self.close(grace_s=0.0)
            self._start()
        try:
            futures = [self._pool.schedule(run_chunk, args=call, timeout=self.hard_timeout_s) for call in calls]
        except RuntimeError:  # the pool broke while scheduling
            return [None] * len(calls)
        return [self._outcome(f) for f in futures]

    def _outcome(self, fut) -> tuple | None:
        try:
            return fut.result()
        except TimeoutError:
            return ("timeout", None, f"no answer within {self.hard_timeout_s:.1f}s; worker killed")
        except pebble.ProcessExpired as e:
            return ("error", None, f"reward worker process died (crashed or exited, code {e.exitcode})")
        except BrokenProcessPool:
            return None
        except Exception as e:  # e.g. arguments that could not be pickled
            return ("error", None, f"{type(e).__name__}: {e}")

    def close(self, grace_s: float = 5.0) -> None:
        """Shut the workers down (those that do not exit within `grace_s` are killed)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        pool.close()
        with contextlib.suppress(TimeoutError):
            pool.join(timeout=grace_s)
            return
        pool.stop()
        pool.join()
