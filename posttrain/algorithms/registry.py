"""Registries mapping config strings to algorithm functions, plus the typed GRPO-family presets.

A preset is a frozen dataclass (`GRPOFamily` and one subclass per algorithm): its fields are every
setting a GRPO-family trainer needs and their defaults are the algorithm's, in one place. Fields:
``advantage`` (key of ``ADVANTAGES``), ``ratio_level`` / ``epsilon_low`` / ``epsilon_high`` /
``aggregation`` / ``beta`` / ``kl_estimator`` / ``max_tokens`` (arguments of
``policy.policy_loss``; ``max_tokens=None`` means "use the generation budget / T"),
``dynamic_sampling`` and ``overlong_filtering`` (DAPO, see ``dapo.py``), ``overlong_penalty``
(add DAPO's soft overlong punishment reward, ``posttrain.rewards.length``) and
``overlong_cache_fraction`` (its ``L_cache`` as a fraction of the generation budget). A preset also
reads as a mapping (``preset["beta"]``, ``dict(preset)``). The DPO family's typed presets live in
``posttrain.algorithms.preference``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import ClassVar, Literal

from posttrain.algorithms.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from posttrain.algorithms.kl import KL_KINDS
from posttrain.algorithms.policy import AGGREGATION_MODES

__all__ = ["ADVANTAGES", "KL_ESTIMATORS", "AGGREGATIONS", "PRESETS", "LOSS_KEYS", "GRPOFamily", "GRPO", "DrGRPO",
           "DAPO", "GSPO", "RLOO", "get", "get_preset", "loss_kwargs"]

ADVANTAGES = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}
KL_ESTIMATORS = dict(KL_KINDS)
AGGREGATIONS = dict(AGGREGATION_MODES)


@dataclasses.dataclass(frozen=True)
class GRPOFamily(collections.abc.Mapping):
    """The settings of a GRPO-family algorithm (see the module docstring); subclasses set their defaults."""

    name: ClassVar[str] = ""
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    ratio_level: Literal["token", "sequence"] = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    beta: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    max_tokens: int | None = None
    dynamic_sampling: bool = False
    overlong_filtering: bool = False
    overlong_penalty: bool = False
    overlong_cache_fraction: float = 0.2

    def __post_init__(self):
        for field, registry in (("advantage", ADVANTAGES), ("aggregation", AGGREGATIONS),
                                ("kl_estimator", KL_ESTIMATORS)):
            if getattr(self, field) not in registry:
                raise ValueError(f"algorithm.{field}={getattr(self, field)!r} is not known; accepted: {sorted(registry)}")
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"algorithm.ratio_level={self.ratio_level!r}; accepted: ['sequence', 'token']")
        for field in ("epsilon_low", "epsilon_high", "beta"):
            if getattr(self, field) < 0:
                raise ValueError(f"algorithm.{field} must be >= 0, found {getattr(self, field)}")
        if not 0.0 < self.overlong_cache_fraction <= 1.0:
            raise ValueError(f"overlong_cache_fraction must be in (0, 1], found {self.overlong_cache_fraction}")

    # a read-only mapping view: preset["beta"], dict(preset), set(preset)
    def __getitem__(self, key: str):
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    @classmethod
    def _keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **overrides) -> "GRPOFamily":
        """A copy with `overrides` (an unknown setting is a ValueError listing the accepted ones)."""
        unknown = sorted(set(overrides) - set(self._keys()))
        if unknown:
            raise ValueError(f"unknown preset setting(s) {unknown}; accepted: {sorted(self._keys())}")
        return dataclasses.replace(self, **overrides)

    def loss_kwargs(self) -> dict:
        """The settings that are keyword arguments of ``policy.policy_loss``."""
        return {k: getattr(self, k) for k in LOSS_KEYS}


@dataclasses.dataclass(frozen=True)
class GRPO(GRPOFamily):
    """Shao et al. 2024 (DeepSeekMath): std-normalised advantages, per-sequence mean, k3 KL."""

    name: ClassVar[str] = "grpo"
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "seq_mean_token_mean"
    beta: float = 0.04


@dataclasses.dataclass(frozen=True)
class DrGRPO(GRPOFamily):
    """Liu et al. 2025 (Dr. GRPO): no std normalisation, constant length normaliser, no KL."""

    name: ClassVar[str] = "dr_grpo"
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "dr_grpo"
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "seq_mean_token_sum_norm"


@dataclasses.dataclass(frozen=True)
class DAPO(GRPOFamily):
    """Yu et al. 2025 (DAPO): clip-higher, token-level mean, dynamic sampling, overlong shaping, no KL."""

    name: ClassVar[str] = "dapo"
    epsilon_high: float = 0.28
    dynamic_sampling: bool = True
    overlong_filtering: bool = True
    overlong_penalty: bool = True


@dataclasses.dataclass(frozen=True)
class GSPO(GRPOFamily):
    """Zheng et al. 2025 (GSPO): sequence-level (length-normalised) ratio with a tiny clip range."""

    name: ClassVar[str] = "gspo"
    ratio_level: Literal["token", "sequence"] = "sequence"
    epsilon_low: float = 3e-4
    epsilon_high: float = 4e-4
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "seq_mean_token_mean"


@dataclasses.dataclass(frozen=True)
class RLOO(GRPOFamily):
    """Ahmadian et al. 2024 (RLOO): leave-one-out baseline."""

    name: ClassVar[str] = "rloo"
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "rloo"


# name -> the preset with its defaults (instances are immutable: `replace` makes a changed copy)
PRESETS: dict[str, GRPOFamily] = {c.name: c() for c in (GRPO, DrGRPO, DAPO, GSPO, RLOO)}

# Preset keys that are keyword arguments of policy.policy_loss.
LOSS_KEYS = ("epsilon_low", "epsilon_high", "ratio_level", "aggregation", "beta", "kl_estimator", "max_tokens")

_NAMES = {
    id(ADVANTAGES): "advantage estimator",
    id(KL_ESTIMATORS): "KL estimator",
    id(AGGREGATIONS): "aggregation mode",
    id(PRESETS): "algorithm preset",
}


def get(registry: dict, name: str):
    """Look ``name`` up in ``registry``; raise ``ValueError`` naming it and listing the accepted keys."""
    try:
        return registry[name]
    except (KeyError, TypeError):
        kind = _NAMES.get(id(registry), "name")
        raise ValueError(f"unknown {kind} {name!r}; accepted: {sorted(registry)}") from None


def get_preset(name: str, **overrides) -> GRPOFamily:
    """The typed preset ``name`` with ``overrides`` applied (unknown settings rejected, values checked)."""
    return get(PRESETS, name).replace(**overrides)


def loss_kwargs(preset) -> dict:
    """The subset of a preset (typed, or a plain mapping) passed as keyword arguments to ``policy_loss``."""
    return {k: preset[k] for k in LOSS_KEYS if k in preset}
