"""Checks that keep a bad reward set-up from wasting a run: every record has the fields the rewards need
(checked up front, naming file and line), and a reward that fails on every completion for several
scoring calls in a row stops the run instead of training on `failure_value` alone."""

from __future__ import annotations

from typing import Sequence

__all__ = ["RewardDataError", "RewardFailedError", "FailureStreak", "check_reward_records"]


class RewardDataError(ValueError):
    """A record lacks a field that a reward needs (the message names the file and line)."""


class RewardFailedError(RuntimeError):
    """A reward failed on every completion for too many scoring calls in a row."""


def check_reward_records(runner, records: Sequence[dict], *, provided: Sequence[str] = ("completion_lengths",),
                         source: str | None = None) -> None:
    """Raises `RewardDataError` for the first record that lacks a field some reward of `runner` requires.

    `provided`: fields the loop adds itself. Records from `posttrain.data.read_prompts` know their file
    and line; other sequences are named by `source` and their 1-based record number.
    """
    where = getattr(records, "where", None) or (lambda i: f"{source or '<records>'}, record {i + 1}")
    extra = set(provided) | {"prompt"}
    needs = [(spec.name, required) for spec, (required, _) in zip(runner.specs, runner._fields) if required]
    for i, rec in enumerate(records):
        have = set(rec) | extra
        for name, required in needs:
            missing = sorted(required - have)
            if missing:
                raise RewardDataError(
                    f"{where(i)}: reward {name!r} needs field(s) {', '.join(repr(m) for m in missing)}, which this "
                    f"record lacks (fields present: {sorted(set(rec))})")


class FailureStreak:
    """Counts, per reward, consecutive scoring calls in which it failed on every completion.

    `update(stats, n)` takes `RewardRunner.score`'s stats for `n` completions and raises
    `RewardFailedError` once a reward has failed on all of them `limit` times in a row (0: never).
    """

    def __init__(self, names: Sequence[str], limit: int):
        self.limit = int(limit)
        self.streak = {name: 0 for name in names}

    def update(self, stats: dict, n: int, errors: dict | None = None) -> None:
        if n <= 0:
            return
        for name in self.streak:
            failed = stats.get(f"reward/{name}/failures", 0.0) >= n
            self.streak[name] = self.streak[name] + 1 if failed else 0
            if self.limit > 0 and self.streak[name] >= self.limit:
                first = (errors or {}).get(name) or []
                why = f"; first problem: {first[0].splitlines()[0]}" if first else ""
                raise RewardFailedError(
                    f"reward {name!r} failed on every completion in {self.streak[name]} scoring calls in a row, so "
                    f"the run has no learning signal; stopping{why}. Fix the reward, or raise "
                    "rewards.max_failed_steps (0 disables this check)")
