"""Registries mapping config strings to algorithm functions, plus named algorithm presets.

``PRESETS[name]`` holds every setting a GRPO-family trainer needs; keys shared by all presets:
``advantage`` (key of ``ADVANTAGES``), ``ratio_level`` / ``epsilon_low`` / ``epsilon_high`` /
``aggregation`` / ``beta`` / ``kl_estimator`` / ``max_tokens`` (arguments of
``policy.policy_loss``; ``max_tokens=None`` means "use the generation budget / T"),
``dynamic_sampling`` and ``overlong_filtering`` (DAPO, see ``dapo.py``), ``overlong_penalty``
(add DAPO's soft overlong punishment reward, ``posttrain.rewards.length``) and
``overlong_cache_fraction`` (its ``L_cache`` as a fraction of the generation budget).
"""

from __future__ import annotations

import copy

from posttrain.algorithms.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from posttrain.algorithms.kl import KL_KINDS
from posttrain.algorithms.policy import AGGREGATION_MODES

__all__ = ["ADVANTAGES", "KL_ESTIMATORS", "AGGREGATIONS", "PRESETS", "LOSS_KEYS", "get", "get_preset", "loss_kwargs"]

ADVANTAGES = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}
KL_ESTIMATORS = dict(KL_KINDS)
AGGREGATIONS = dict(AGGREGATION_MODES)

_COMMON = {
    "advantage": "grpo",
    "ratio_level": "token",
    "epsilon_low": 0.2,
    "epsilon_high": 0.2,
    "aggregation": "token_mean",
    "beta": 0.0,
    "kl_estimator": "k3",
    "max_tokens": None,
    "dynamic_sampling": False,
    "overlong_filtering": False,
    "overlong_penalty": False,
    "overlong_cache_fraction": 0.2,
}

PRESETS = {
    # Shao et al. 2024 (DeepSeekMath): std-normalised advantages, per-sequence mean, k3 KL.
    "grpo": {**_COMMON, "aggregation": "seq_mean_token_mean", "beta": 0.04},
    # Liu et al. 2025: no std normalisation, constant length normaliser, no KL.
    "dr_grpo": {**_COMMON, "advantage": "dr_grpo", "aggregation": "seq_mean_token_sum_norm"},
    # Yu et al. 2025: clip-higher, token-level mean, dynamic sampling, overlong shaping, no KL.
    "dapo": {
        **_COMMON,
        "epsilon_high": 0.28,
        "dynamic_sampling": True,
        "overlong_filtering": True,
        "overlong_penalty": True,
    },
    # Zheng et al. 2025: sequence-level (length-normalised) ratio with tiny clip range.
    "gspo": {
        **_COMMON,
        "ratio_level": "sequence",
        "epsilon_low": 3e-4,
        "epsilon_high": 4e-4,
        "aggregation": "seq_mean_token_mean",
    },
    # Ahmadian et al. 2024: leave-one-out baseline.
    "rloo": {**_COMMON, "advantage": "rloo"},
}

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


def get_preset(name: str, **overrides) -> dict:
    """A fresh copy of ``PRESETS[name]`` with ``overrides`` applied (unknown keys rejected)."""
    preset = copy.deepcopy(get(PRESETS, name))
    unknown = sorted(set(overrides) - set(preset))
    if unknown:
        raise ValueError(f"unknown preset setting(s) {unknown}; accepted: {sorted(preset)}")
    preset.update(overrides)
    return preset


def loss_kwargs(preset: dict) -> dict:
    """The subset of a preset that is passed as keyword arguments to ``policy_loss``."""
    return {k: preset[k] for k in LOSS_KEYS if k in preset}
