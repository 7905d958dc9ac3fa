"""Reward loading and fault-tolerant execution: resolve reward specs and score completions in a
reusable process pool with per-call time limits, turning any reward failure into a fixed
``failure_value`` (with counts) instead of crashing the training loop.

A reward is ``fn(prompts: list[str], completions: list[str], **fields) -> list[float]``; fields
are the data set's other columns aligned with ``completions``. Parameters after the first two
that have no default (or names listed in ``fn.required_fields``) are required fields and are
checked before anything runs. Rewards are referenced by a built-in name (``math_answer``,
``format``, ``overlong_penalty``, ``reasoning_gym``), ``"package.module:function"`` or ``"path/to/file.py:function"``.
``RewardSpec.kwargs`` configure a factory (a callable with ``is_reward_factory = True``, e.g.
``overlong_penalty``) or are otherwise passed to every call.

Time limits: inside a worker each call runs under ``signal.setitimer`` (a soft limit that
interrupts Python code, so the worker survives); if a worker still has not answered
``hard_timeout_grace_s`` after that, the pool is killed and recreated, and unaffected chunks
are re-run. A worker that dies (segfault, ``os._exit``) has its chunks retried once alone.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import multiprocessing
import numbers
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable

import numpy as np

from posttrain.rewards.checks import FailureStreak
from posttrain.rewards.format import format_reward
from posttrain.rewards.length import overlong_penalty
from posttrain.rewards.math_answer import math_answer
from posttrain.rewards.reasoning_gym import reasoning_gym_reward

__all__ = [
    "BUILTIN_REWARDS",
    "RewardSpec",
    "RewardRunner",
    "load_reward",
    "resolve_reward",
    "reward_fields",
]

logger = logging.getLogger(__name__)

BUILTIN_REWARDS: dict[str, Callable] = {
    "math_answer": math_answer,
    "format": format_reward,
    "format_reward": format_reward,
    "overlong_penalty": overlong_penalty,
    "reasoning_gym": reasoning_gym_reward,
}

_FILE_MODULES: dict[str, Any] = {}


# --------------------------------------------------------------------------------------------
# Resolving references
# --------------------------------------------------------------------------------------------


def _get_attr_path(obj: Any, attr: str, where: str) -> Any:
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise ValueError(f"reward {attr!r} not found in {where}; callables there: {public}")
        obj = getattr(obj, part)
    return obj


def _load_file_module(path_str: str):
    path = Path(path_str).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward file {path_str!r} not found (resolved to {path})")
    key = str(path)
    if key not in _FILE_MODULES:
        mod_name = "_posttrain_reward_file_" + hashlib.sha1(key.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import reward file {path_str!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise ValueError(f"error while importing reward file {path_str!r}: {type(e).__name__}: {e}") from e
        _FILE_MODULES[key] = module
    return _FILE_MODULES[key]


def load_reward(spec: str) -> Callable:
    """Resolve a reward reference string to a callable (factories are returned unapplied).

    Accepts a built-in name (``BUILTIN_REWARDS``), ``"package.module:function"`` or
    ``"path/to/file.py:function"``. Raises ``ValueError`` with the reason when it cannot.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward reference must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(
            f"unknown reward {spec!r}; built-in rewards: {sorted(BUILTIN_REWARDS)}; "
            "or use 'package.module:function' or 'path/to/file.py:function'"
        )
    target, attr = spec.rsplit(":", 1)
    if not attr:
        raise ValueError(f"reward reference {spec!r} names no function after ':'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _load_file_module(target)
        where = f"file {target!r}"
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"cannot import reward module {target!r} (from {spec!r}): {e}") from e
        where = f"module {target!r}"
    fn = _get_attr_path(module, attr, where)
    if not callable(fn):
        raise ValueError(f"reward {spec!r} resolved to a non-callable {type(fn).__name__}")
    return fn


def resolve_reward(ref: str | Callable, kwargs: dict | None = None) -> Callable:
    """A ready-to-call reward: ``ref`` loaded (if a string), then a factory applied to
    ``kwargs`` or ``kwargs`` bound with ``functools.partial``."""
    fn = load_reward(ref) if isinstance(ref, str) else ref
    if not callable(fn):
        raise ValueError(f"reward must be callable or a reference string, got {type(fn).__name__}")
    kwargs = dict(kwargs or {})
    if getattr(fn, "is_reward_factory", False):
        try:
            return fn(**kwargs)
        except TypeError as e:
            raise ValueError(f"reward factory {getattr(fn, '__name__', fn)!r} rejected kwargs {kwargs}: {e}") from e
    return functools.partial(fn, **kwargs) if kwargs else fn


def reward_fields(fn: Callable) -> tuple[set[str], set[str] | None]:
    """``(required, accepted)`` field names of a resolved reward.

    ``required``: parameters after ``prompts, completions`` without a default, plus any names
    in ``required_fields``. ``accepted``: all named field parameters, or None if the reward
    takes ``**fields`` (then every field is passed).
    """
    declared = set(getattr(fn, "required_fields", ()) or ())
    if isinstance(fn, functools.partial):
        declared |= set(getattr(fn.func, "required_fields", ()) or ())
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return declared, None
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_var_pos = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not has_var_pos:
        raise ValueError(
            f"reward {getattr(fn, '__name__', fn)!r} must accept (prompts, completions, **fields); signature is {sig}"
        )
    rest = positional[2:] + [p for p in params if p.kind == p.KEYWORD_ONLY]
    required = {p.name for p in rest if p.default is p.empty} | declared
    accepted = None if any(p.kind == p.VAR_KEYWORD for p in params) else {p.name for p in rest}
    return required, accepted


@dataclasses.dataclass
class RewardSpec:
    """One reward term: ``weight * fn(prompts, completions, **fields)``.

    ``fn`` is a callable (picklable, i.e. defined at module top level, when run in worker
    processes) or a reference string for ``load_reward``; ``None`` means ``name`` is the
    reference. ``kwargs`` configure a factory or are bound to every call.
    """

    name: str
    fn: Callable | str | None = None
    weight: float = 1.0
    kwargs: dict = dataclasses.field(default_factory=dict)

    @property
    def ref(self) -> Callable | str:
        return self.name if self.fn is None else self.fn

    @classmethod
    def coerce(cls, obj: Any) -> "RewardSpec":
        """Build a spec from a ``RewardSpec``, reference string, callable, or dict of fields."""
        if isinstance(obj, RewardSpec):
            return obj
        if isinstance(obj, str):
            name = obj if obj in BUILTIN_REWARDS else obj.rsplit(":", 1)[-1]
            return cls(name=name, fn=obj)
        if isinstance(obj, dict):
            unknown = set(obj) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"unknown RewardSpec key(s) {sorted(unknown)}; accepted: name, fn, weight, kwargs")
            if "name" not in obj:
                raise ValueError(f"RewardSpec dict needs a 'name': {obj}")
            return cls(**obj)
        if callable(obj):
            name = getattr(obj, "__name__", None) or type(obj).__name__
            return cls(name=name, fn=obj)
        raise ValueError(f"cannot build a RewardSpec from {type(obj).__name__}: {obj!r}")


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


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


def _run_chunk(ref, kwargs, prompts, completions, fields, timeout_s):
    """Run one reward on one chunk. Returns ``(status, values, message)``; never raises.

    status: ``ok`` (values: list of float or None for NaN/inf/non-numbers), ``error``,
    ``timeout`` or ``bad_length`` (values None).
    """
    try:
        fn = _worker_resolve(ref, kwargs)
    except Exception as e:
        return ("error", None, f"cannot load reward: {type(e).__name__}: {e}")
    try:
        with _soft_time_limit(timeout_s):
            out = fn(list(prompts), list(completions), **fields)
    except _SoftTimeout:
        return ("timeout", None, f"call exceeded the {timeout_s}s time limit")
    except BaseException as e:  # noqa: BLE001 - a reward must never take the worker down
        tb = traceback.format_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        return ("error", None, f"{type(e).__name__}: {e}\n{''.join(tb[-3:])}")
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


def _process_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (tells a live process from a later one given the same pid)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _owner_alive(pid: int, start_time: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start_time is None or _process_start_time(pid) in (start_time, None)


def _watch_owner(pid: int, start_time: str | None, interval_s: float) -> None:
    """Ends this worker when the process that owns the pool is gone (killed with SIGKILL, say): workers are
    children of the fork server, not of the owner, so nothing else would tell them."""
    parent = os.getppid()
    while True:
        time.sleep(interval_s)
        if os.getppid() != parent or not _owner_alive(pid, start_time):
            os._exit(1)


def _worker_init(owner_pid: int | None = None, owner_start: str | None = None, interval_s: float = 1.0):
    # Workers must not take Ctrl-C down mid-call; the parent owns shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if owner_pid is not None:
        threading.Thread(target=_watch_owner, args=(owner_pid, owner_start, interval_s), daemon=True,
                         name="owner-watch").start()
    with contextlib.suppress(Exception):
        import math_verify  # noqa: F401  (pre-import so the first math_answer call is fast)


def _ping():
    return os.getpid()


# --------------------------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    spec_index: int
    start: int
    stop: int
    args: tuple


class RewardRunner:
    """Scores completions with weighted rewards in a reusable process pool.

    Args:
      specs: ``RewardSpec``s (or anything ``RewardSpec.coerce`` accepts); names must be unique.
      timeout_s: time limit for one reward call on one chunk (None: unlimited).
      failure_value: value given to completions whose reward raised, timed out, returned the
        wrong length or a NaN/non-number.
      num_workers: worker processes; 0 runs in-process (soft time limit only in the main
        thread). Default ``min(4, cpu_count)``.
      chunk_size: completions per call, so one slow item only delays / fails its chunk.
      mp_context: ``"forkserver"`` (default where available) or ``"spawn"``.
      hard_timeout_grace_s: extra seconds after ``timeout_s`` before a silent worker is killed.
      max_failed_calls: raise ``RewardFailedError`` once a reward has failed on every completion in
        this many ``score`` calls in a row (0: never).

    Workers exit on their own within about a second when the process that created the pool dies.
    """

    def __init__(
        self,
        specs,
        timeout_s: float | None = 10.0,
        failure_value: float = 0.0,
        num_workers: int | None = None,
        chunk_size: int = 8,
        mp_context: str | None = None,
        hard_timeout_grace_s: float = 5.0,
        max_failed_calls: int = 0,
    ):
        self.specs = [RewardSpec.coerce(s) for s in specs]  # none: every total is 0 (on-policy distillation)
        names = [s.name for s in self.specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate reward names {dupes}; give each RewardSpec a unique name")
        self.timeout_s = timeout_s
        self.failure_value = float(failure_value)
        self.num_workers = min(4, os.cpu_count() or 1) if num_workers is None else int(num_workers)
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = int(chunk_size)
        self.hard_timeout_grace_s = float(hard_timeout_grace_s)
        if mp_context is None:
            mp_context = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        if mp_context not in ("forkserver", "spawn"):
            raise ValueError(f"mp_context must be 'forkserver' or 'spawn', got {mp_context!r}")
        self.mp_context = mp_context

        self._fields: list[tuple[set[str], set[str] | None]] = []
        for spec in self.specs:
            try:
                fn = resolve_reward(spec.ref, spec.kwargs)
                self._fields.append(reward_fields(fn))
            except ValueError as e:
                raise ValueError(f"reward {spec.name!r}: {e}") from e
            if self.num_workers > 0:
                try:
                    pickle.dumps((spec.ref, spec.kwargs))
                except Exception as e:
                    raise ValueError(
                        f"reward {spec.name!r} cannot be sent to worker processes ({type(e).__name__}: {e}); "
                        "define it at module top level, reference it as 'module:function' or "
                        "'path/file.py:function', or use num_workers=0"
                    ) from e
        self._pool: cf.ProcessPoolExecutor | None = None
        self.last_errors: dict[str, list[str]] = {}
        self.failure_streak = FailureStreak([s.name for s in self.specs], max_failed_calls)

    # ---------------------------------------------------------------- field checks
    def check_records(self, records, **kwargs) -> None:
        """Every record has every field the rewards need (see `posttrain.rewards.checks.check_reward_records`)."""
        from posttrain.rewards.checks import check_reward_records

        check_reward_records(self, records, **kwargs)

    def check_fields(self, field_names) -> None:
        """Raise ``ValueError`` naming the field if some reward needs a field not in ``field_names``."""
        available = set(field_names)
        for spec, (required, _) in zip(self.specs, self._fields):
            missing = sorted(required - available)
            if missing:
                raise ValueError(
                    f"reward {spec.name!r} requires field(s) {', '.join(repr(m) for m in missing)} "
                    f"which the data set does not provide (available fields: {sorted(available)})"
                )

    # ---------------------------------------------------------------- pool management
    def _ensure_pool(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            ctx = multiprocessing.get_context(self.mp_context)
            if self.mp_context == "forkserver":
                # Import the reward stack once in the fork server so (re)started workers are
                # forked ready to run (restarting after a kill then takes milliseconds).
                # Takes effect only if this process has not started its fork server yet.
                ctx.set_forkserver_preload(["__main__", "posttrain.rewards.runner", "math_verify"])
            owner = os.getpid()
            pool = cf.ProcessPoolExecutor(max_workers=self.num_workers, mp_context=ctx, initializer=_worker_init,
                                          initargs=(owner, _process_start_time(owner)))
            self._pool = pool
            try:
                warm = [pool.submit(_ping) for _ in range(self.num_workers)]
                done, not_done = cf.wait(warm, timeout=120)
                problem = next((f.exception() for f in done if f.exception() is not None), None)
                if not_done:
                    problem = TimeoutError("no answer within 120 s")
            except Exception as e:
                problem = e
            if problem is not None:
                self._kill_pool()
                raise RuntimeError(
                    f"reward worker processes ({self.mp_context}) failed to start: {type(problem).__name__}: {problem}. "
                    "The main module must be importable (not stdin); or use num_workers=0."
                ) from problem
        return self._pool

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        procs = list((getattr(pool, "_processes", None) or {}).values())
        for p in procs:
            with contextlib.suppress(Exception):
                if p.is_alive():
                    p.kill()
        with contextlib.suppress(Exception):
            pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            with contextlib.suppress(Exception):
                p.join(timeout=2)

    def close(self) -> None:
        """Shut the worker pool down (workers that do not exit within 5 s are killed)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        procs = list((getattr(pool, "_processes", None) or {}).values())
        with contextlib.suppress(Exception):
            pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + 5.0
        for p in procs:
            with contextlib.suppress(Exception):
                p.join(timeout=max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(timeout=1)

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- execution
    def _execute(self, jobs: list[_Job]) -> list[tuple]:
        results: list[tuple | None] = [None] * len(jobs)
        if self.num_workers == 0:
            for k, job in enumerate(jobs):
                results[k] = _run_chunk(*job.args)
            return results  # type: ignore[return-value]

        hard = None if self.timeout_s is None else self.timeout_s + self.hard_timeout_grace_s
        pending = collections.deque(range(len(jobs)))
        suspects: set[int] = set()  # jobs that were running when a worker died: rerun alone
        inflight: dict[cf.Future, tuple[int, float | None]] = {}
        while pending or inflight:
            while pending and len(inflight) < self.num_workers:
                k = pending[0]
                if k in suspects and inflight:
                    break
                pending.popleft()
                pool = self._ensure_pool()
                try:
                    fut = pool.submit(_run_chunk, *jobs[k].args)
                except (BrokenProcessPool, RuntimeError):
                    self._kill_pool()
                    pending.appendleft(k)
                    continue
                inflight[fut] = (k, None if hard is None else time.monotonic() + hard)
                if k in suspects:
                    break
            deadlines = [d for _, d in inflight.values() if d is not None]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            done, _ = cf.wait(list(inflight), timeout=wait_s, return_when=cf.FIRST_COMPLETED)

            broken: list[int] = []
            for fut in done:
                k, _ = inflight.pop(fut)
                try:
                    results[k] = fut.result()
                except BrokenProcessPool:
                    broken.append(k)
                except Exception as e:  # e.g. arguments that could not be pickled
                    results[k] = ("error", None, f"{type(e).__name__}: {e}")
            if broken:
                for fut in list(inflight):
                    k, _ = inflight.pop(fut)
                    if fut.done() and fut.exception() is None:
                        results[k] = fut.result()
                    else:
                        broken.append(k)
                self._kill_pool()
                for k in broken:
                    if k in suspects:  # it died running alone: it is the culprit
                        results[k] = ("error", None, "reward worker process died (crashed or exited)")
                    else:
                        suspects.add(k)
                        pending.append(k)
                continue

            now = time.monotonic()
            expired = [f for f, (_, d) in inflight.items() if d is not None and now >= d and not f.done()]
            if expired:
                for fut in expired:
                    k, _ = inflight.pop(fut)
                    results[k] = ("timeout", None, f"no answer within {hard:.1f}s; worker killed")
                for fut in list(inflight):  # innocent bystanders: keep finished results, rerun the rest
                    k, _ = inflight.pop(fut)
                    if fut.done() and fut.exception() is None:
                        results[k] = fut.result()
                    else:
                        pending.appendleft(k)
                self._kill_pool()
        return results  # type: ignore[return-value]

    def score(self, prompts, completions, fields: dict[str, list] | None = None):
        """Score ``completions`` with every reward.

        Returns ``(total, per_reward, stats)``: ``total`` float32 ``[N]`` is the weighted sum,
        ``per_reward`` maps name -> float32 ``[N]`` (failures replaced by ``failure_value``),
        ``stats`` holds ``reward/<name>`` (mean), ``reward/<name>/failures`` (completions that got
        ``failure_value``, timeouts included), ``reward/<name>/timeouts`` and ``reward/total``.
        Raises ``ValueError`` only for caller errors (length mismatch, missing fields).
        """
        completions = list(completions)
        prompts = list(prompts)
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} completions; pass one prompt per completion")
        fields = {k: list(v) for k, v in (fields or {}).items()}
        for key, col in fields.items():
            if len(col) != n:
                raise ValueError(f"field {key!r} has {len(col)} values for {n} completions")
        self.check_fields(fields)

        jobs: list[_Job] = []
        for i, (spec, (_, accepted)) in enumerate(zip(self.specs, self._fields)):
            passed = fields if accepted is None else {k: v for k, v in fields.items() if k in accepted}
            for start in range(0, n, self.chunk_size):
                stop = min(n, start + self.chunk_size)
                chunk_fields = {k: v[start:stop] for k, v in passed.items()}
                args = (spec.ref, spec.kwargs, prompts[start:stop], completions[start:stop], chunk_fields, self.timeout_s)
                jobs.append(_Job(i, start, stop, args))
        results = self._execute(jobs) if jobs else []

        values = np.full((len(self.specs), n), np.nan, dtype=np.float64)
        failed = np.zeros((len(self.specs), n), dtype=bool)
        timed_out = np.zeros((len(self.specs), n), dtype=bool)
        errors: dict[str, list[str]] = {s.name: [] for s in self.specs}
        for job, (status, vals, msg) in zip(jobs, results):
            sl = slice(job.start, job.stop)
            name = self.specs[job.spec_index].name
            if status == "ok":
                arr = np.array([np.nan if v is None else v for v in vals], dtype=np.float64)
                values[job.spec_index, sl] = arr
                failed[job.spec_index, sl] = np.isnan(arr)
            else:
                failed[job.spec_index, sl] = True
                timed_out[job.spec_index, sl] = status == "timeout"
            if msg:
                errors[name].append(f"[{job.start}:{job.stop}] {status}: {msg}")

        values[failed] = self.failure_value
        per_reward = {s.name: values[i].astype(np.float32) for i, s in enumerate(self.specs)}
        weights = np.array([float(s.weight) for s in self.specs], dtype=np.float64)[:, None]
        total = (weights * values).sum(axis=0).astype(np.float32)

        stats: dict[str, float] = {}
        for i, spec in enumerate(self.specs):
            stats[f"reward/{spec.name}"] = float(values[i].mean()) if n else 0.0
            stats[f"reward/{spec.name}/failures"] = float(failed[i].sum())
            stats[f"reward/{spec.name}/timeouts"] = float(timed_out[i].sum())
            if errors[spec.name]:
                logger.warning(
                    "reward %r: %d completion(s) got failure_value %s; first problem: %s",
                    spec.name, int(failed[i].sum()), self.failure_value, errors[spec.name][0],
                )
        stats["reward/total"] = float(total.mean()) if n else 0.0
        self.last_errors = errors
        self.failure_streak.update(stats, n, errors)
        return total, per_reward, stats
