"""Which rewards a run uses: built-in names, references resolved by the one loader (`posttrain.loading`),
factories applied to their settings, and the data set fields each reward needs.

A reward is ``fn(prompts: list[str], completions: list[str], **fields) -> list[float]``; fields are the
data set's other columns aligned with ``completions``. Parameters after the first two that have no default
(or names listed in ``fn.required_fields``) are required fields and are checked before anything runs.
Rewards are referenced by a built-in name (``math_answer``, ``format``, ``overlong_penalty``,
``reasoning_gym``, ``judge``), ``"package.module:function"`` or ``"path/to/file.py:function"``. ``RewardSpec.kwargs``
configure a factory (a callable with ``is_reward_factory = True``, e.g. ``overlong_penalty``) or are
otherwise passed to every call.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

from posttrain.loading import LoadError, load_callable
from posttrain.rewards.exact import exact_answer
from posttrain.rewards.format import format_reward
from posttrain.rewards.judge import judge
from posttrain.rewards.length import overlong_penalty
from posttrain.rewards.math_answer import math_answer
from posttrain.rewards.reasoning_gym import reasoning_gym_reward

__all__ = ["BUILTIN_REWARDS", "RewardSpec", "load_reward", "resolve_reward", "reward_fields"]

BUILTIN_REWARDS: dict[str, Callable] = {
    "math_answer": math_answer,
    "exact_answer": exact_answer,
    "format": format_reward,
    "format_reward": format_reward,
    "overlong_penalty": overlong_penalty,
    "reasoning_gym": reasoning_gym_reward,
    "judge": judge,
}


def load_reward(spec: str) -> Callable:
    """Resolve a reward reference string to a callable (factories are returned unapplied).

    Accepts a built-in name (``BUILTIN_REWARDS``), ``"package.module:function"`` or
    ``"path/to/file.py:function"``. Raises ``LoadError`` (a ``ValueError``) with the reason when it cannot.
    """
    return load_callable(spec, what="reward", builtins=BUILTIN_REWARDS)


def resolve_reward(ref: str | Callable, kwargs: dict | None = None) -> Callable:
    """A ready-to-call reward: ``ref`` loaded (if a string), then a factory applied to
    ``kwargs`` or ``kwargs`` bound with ``functools.partial``."""
    fn = load_reward(ref) if isinstance(ref, str) else ref
    if not callable(fn):
        raise LoadError(f"reward must be callable or a reference string, got {type(fn).__name__}")
    kwargs = dict(kwargs or {})
    if getattr(fn, "is_reward_factory", False):
        try:
            return fn(**kwargs)
        except TypeError as e:
            raise LoadError(f"reward factory {getattr(fn, '__name__', fn)!r} rejected kwargs {kwargs}: {e}") from None
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
        raise LoadError(
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
