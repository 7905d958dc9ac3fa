"""Scoring completions with weighted rewards, turning any reward failure into a fixed ``failure_value``
(with counts) instead of crashing the training loop.

Which rewards and the fields they need: `posttrain.rewards.loading`. Where the calls run: a reusable process
pool with per-call time limits (`posttrain.rewards.pool`), or in-process with ``num_workers=0``. A score
call splits the completions into chunks, so one slow or failing item only delays / fails its chunk. A reward may
return counts of its own (`posttrain.rewards.scored`). Rewards that start early (the judge: our own code, calls to a
model under its own time limits) run in this process instead, on their own threads (`EarlyScores`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import multiprocessing
import os
import pickle

import numpy as np

from posttrain.loading import LoadError
from posttrain.rewards.checks import FailureStreak, check_reward_records
from posttrain.rewards.loading import BUILTIN_REWARDS, RewardSpec, load_reward, resolve_reward, reward_fields
from posttrain.rewards.pool import RewardPool, run_chunk, settle

__all__ = [
    "BUILTIN_REWARDS",
    "EarlyScores",
    "RewardSpec",
    "RewardRunner",
    "load_reward",
    "resolve_reward",
    "reward_fields",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Job:
    spec_index: int
    start: int
    stop: int
    args: tuple


class EarlyScores:
    """One scoring call's completions handed, one by one as they are sampled (`add`), to the rewards that start
    early (`starts_early`, with `submit(prompt, completion, **fields) -> Future` and `collect(futures) -> Scored`:
    the judge, whose requests then overlap the decoding of the other sequences). They run in this process (their own
    threads and time limits). `RewardRunner.score(..., early=)` collects their answers instead of calling them."""

    def __init__(self, fns: dict[int, object]):
        self.fns = fns
        self.futures: dict[int, dict[int, cf.Future]] = {i: {} for i in fns}

    def add(self, k: int, prompt, completion, fields: dict) -> None:
        """Completion `k` of the call (its prompt text, text and fields) is sampled: the early rewards get it now."""
        for i, fn in self.fns.items():
            self.futures[i][k] = fn.submit(prompt, completion, **fields)

    def result(self, i: int, prompts: list, completions: list, fields: dict[str, list]) -> tuple:
        """Reward `i`'s answer on every completion as `run_chunk`'s tuple (completions never added are asked now)."""
        fn = self.fns[i]
        try:
            futures = [self.futures[i].get(k) or fn.submit(prompts[k], completions[k], **{f: v[k] for f, v in
                                                                                          fields.items()})
                       for k in range(len(completions))]
            return settle(fn.collect(futures), len(completions))
        except Exception as e:  # noqa: BLE001 - a failing reward is counted, never a crash
            return ("error", None, " ".join(f"{type(e).__name__}: {e}".split()), {})


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

        self._fns: list = []  # the resolved rewards (those that start early run in this process)
        self._closers: list = []  # `on_close`
        self._fields = [self._resolve(spec) for spec in self.specs]
        self._pool: RewardPool | None = None  # started on the first call that needs it
        self.last_errors: dict[str, list[str]] = {}
        self._warned: set[tuple[str, str]] = set()  # (reward, kind of failure) already printed
        self.failure_streak = FailureStreak([s.name for s in self.specs], max_failed_calls)

    def _resolve(self, spec: RewardSpec) -> tuple[set[str], set[str] | None]:
        """The (required, accepted) fields of `spec`'s reward, loaded here to fail before any worker starts;
        a reference that cannot be loaded or sent to the workers is a one-line `LoadError`."""
        try:
            fn = resolve_reward(spec.ref, spec.kwargs)
            fields = reward_fields(fn)
        except ValueError as e:  # LoadError, or a factory refusing its settings
            raise LoadError(f"reward {spec.name!r}: {' '.join(str(e).split())}") from None
        self._fns.append(fn)
        if self.num_workers > 0:
            try:
                pickle.dumps((spec.ref, spec.kwargs))
            except Exception as e:
                raise LoadError(
                    f"reward {spec.name!r} cannot be sent to worker processes ({type(e).__name__}: {e}); "
                    "define it at module top level, reference it as 'module:function' or "
                    "'path/file.py:function', or use num_workers=0"
                ) from None
        return fields

    # ---------------------------------------------------------------- field checks
    def check_records(self, records, **kwargs) -> None:
        """Every record has every field the rewards need (see `posttrain.rewards.checks.check_reward_records`)."""
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

    # ---------------------------------------------------------------- execution
    @property
    def functions(self) -> list:
        """The resolved reward callables, in `specs` order (the judge's `Judge` among them)."""
        return list(self._fns)

    def on_close(self, fn) -> None:
        """`fn()` runs when the runner closes (after its pool): what serves its rewards (a local judge's server)."""
        self._closers.append(fn)

    def close(self) -> None:
        """Shut the worker pool down (workers that do not exit within 5 s are killed), then what `on_close` named."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        closers, self._closers = self._closers, []
        for fn in reversed(closers):
            fn()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _execute(self, jobs: list[_Job]) -> list[tuple]:
        if self.num_workers == 0:
            return [run_chunk(*job.args) for job in jobs]
        if self._pool is None:
            hard = None if self.timeout_s is None else self.timeout_s + self.hard_timeout_grace_s
            self._pool = RewardPool(self.num_workers, self.mp_context, hard)
        return self._pool.run([job.args for job in jobs])

    def early(self) -> EarlyScores | None:
        """An `EarlyScores` for the next scoring call when some reward starts early (None: none does)."""
        fns = {i: fn for i, fn in enumerate(self._fns) if getattr(fn, "starts_early", False)
               and callable(getattr(fn, "submit", None)) and callable(getattr(fn, "collect", None))}
        return EarlyScores(fns) if fns else None

    def _jobs(self, i: int, prompts: list, completions: list, passed: dict[str, list]) -> list[_Job]:
        """Reward `i`'s calls on the completions, in chunks of `chunk_size`."""
        spec, n = self.specs[i], len(completions)
        out = []
        for start in range(0, n, self.chunk_size):
            stop = min(n, start + self.chunk_size)
            args = (spec.ref, spec.kwargs, prompts[start:stop], completions[start:stop],
                    {k: v[start:stop] for k, v in passed.items()}, self.timeout_s)
            out.append(_Job(i, start, stop, args))
        return out

    def _warn_once(self, name: str, failed: int, errors: list[str], kinds: list[str]) -> None:
        """One warning line the first time reward `name` fails in each way (an exception type, `timeout`, ...);
        later failures are counted in `reward/<name>/failures` only."""
        new = next((k for k in range(len(kinds)) if (name, kinds[k]) not in self._warned), None)
        if new is None:
            return
        self._warned.add((name, kinds[new]))
        logger.warning("reward %r: %d completion(s) got failure_value %s: %s (counted in reward/%s/failures; "
                       "this kind is not printed again)", name, failed, self.failure_value, errors[new], name)

    def score(self, prompts, completions, fields: dict[str, list] | None = None, early: EarlyScores | None = None):
        """Score ``completions`` with every reward (those that start early answer from ``early``, made by `early()`
        and fed as the completions were sampled, else from a fresh one).

        Returns ``(total, per_reward, stats)``: ``total`` float32 ``[N]`` is the weighted sum,
        ``per_reward`` maps name -> float32 ``[N]`` (failures replaced by ``failure_value``),
        ``stats`` holds ``reward/<name>`` (mean), ``reward/<name>/failures`` (completions that got
        ``failure_value``, timeouts included), ``reward/<name>/timeouts``, the counts a reward reports itself
        (``reward/<name>/<count>``, `posttrain.rewards.scored.Scored`) and ``reward/total``.
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

        early = early if early is not None else self.early()
        jobs: list[_Job] = []
        answered: dict[int, tuple] = {}  # job index -> the early rewards' answers
        for i, (_, accepted) in enumerate(self._fields):
            passed = fields if accepted is None else {k: v for k, v in fields.items() if k in accepted}
            if early is not None and i in early.fns:
                answered[len(jobs)] = early.result(i, prompts, completions, passed)
                jobs.append(_Job(i, 0, n, ()))
            else:
                jobs += self._jobs(i, prompts, completions, passed)
        pooled = iter(self._execute([j for k, j in enumerate(jobs) if k not in answered]) if len(jobs) > len(answered)
                      else [])
        results = [answered[k] if k in answered else next(pooled) for k in range(len(jobs))]

        values = np.full((len(self.specs), n), np.nan, dtype=np.float64)
        failed = np.zeros((len(self.specs), n), dtype=bool)
        timed_out = np.zeros((len(self.specs), n), dtype=bool)
        errors: dict[str, list[str]] = {s.name: [] for s in self.specs}
        kinds: dict[str, list[str]] = {s.name: [] for s in self.specs}
        own: dict[str, dict[str, float]] = {s.name: {} for s in self.specs}  # counts rewards report (`Scored`)
        for job, (status, vals, msg, counts) in zip(jobs, results):
            sl = slice(job.start, job.stop)
            name = self.specs[job.spec_index].name
            for key, value in counts.items():
                own[name][key] = own[name].get(key, 0.0) + float(value)
            if status == "ok":
                arr = np.array([np.nan if v is None else v for v in vals], dtype=np.float64)
                values[job.spec_index, sl] = arr
                failed[job.spec_index, sl] = np.isnan(arr)
            else:
                failed[job.spec_index, sl] = True
                timed_out[job.spec_index, sl] = status == "timeout"
            if msg:
                errors[name].append(f"[{job.start}:{job.stop}] {status}: {msg}")
                kinds[name].append(status if status != "error" else msg.split(":", 1)[0])

        values[failed] = self.failure_value
        per_reward = {s.name: values[i].astype(np.float32) for i, s in enumerate(self.specs)}
        weights = np.array([float(s.weight) for s in self.specs], dtype=np.float64)[:, None]
        total = (weights * values).sum(axis=0).astype(np.float32)

        stats: dict[str, float] = {}
        for i, spec in enumerate(self.specs):
            stats[f"reward/{spec.name}"] = float(values[i].mean()) if n else 0.0
            stats[f"reward/{spec.name}/failures"] = float(failed[i].sum())
            stats[f"reward/{spec.name}/timeouts"] = float(timed_out[i].sum())
            stats.update({f"reward/{spec.name}/{key}": value for key, value in own[spec.name].items()})
            self._warn_once(spec.name, int(failed[i].sum()), errors[spec.name], kinds[spec.name])
        stats["reward/total"] = float(total.mean()) if n else 0.0
        self.last_errors = errors
        self.failure_streak.update(stats, n, errors)
        return total, per_reward, stats
