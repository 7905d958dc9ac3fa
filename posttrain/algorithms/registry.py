"""Registries mapping config strings to algorithm functions, plus the typed GRPO-family presets.

A preset is a frozen dataclass (`GRPOFamily` and one subclass per algorithm): its fields are every
setting a GRPO-family trainer needs and their defaults are the algorithm's, in one place. Fields:
``preset`` (its name), ``advantage`` (key of ``ADVANTAGES``), ``ratio_level`` / ``epsilon_low`` /
``epsilon_high`` / ``aggregation`` / ``beta`` / ``kl_estimator`` / ``max_tokens`` (arguments of
``policy.policy_loss``; ``max_tokens=None`` means "use the generation budget / T"),
``dynamic_sampling`` and ``overlong_filtering`` (DAPO, see ``dapo.py``), ``overlong_penalty``
(add DAPO's soft overlong punishment reward, ``posttrain.rewards.length``) and
``overlong_cache_fraction`` (its ``L_cache`` as a fraction of the generation budget).

The RL config's `algorithm` section is parsed straight into a preset: ``GRPOFamily(preset=NAME, **settings)`` is
preset NAME's class with the settings given (the others keep that class's defaults), which is how the config
loader (`posttrain.config.from_dict`) builds the section; an unknown or ill-typed key is a `ConfigError` naming
it and the accepted values. The DPO family's typed presets live in ``posttrain.algorithms.preference``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, get_args

from posttrain.algorithms.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from posttrain.algorithms.kl import KL_KINDS
from posttrain.algorithms.policy import AGGREGATION_MODES

__all__ = ["ADVANTAGES", "KL_ESTIMATORS", "AGGREGATIONS", "PRESETS", "LOSS_KEYS", "PresetName", "GRPOFamily", "GRPO",
           "DrGRPO", "DAPO", "GSPO", "RLOO", "get", "get_preset", "loss_kwargs"]

ADVANTAGES = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}
KL_ESTIMATORS = dict(KL_KINDS)
AGGREGATIONS = dict(AGGREGATION_MODES)


PresetName = Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo"]
AggregationName = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]

# settings that were the algorithm section's and are the RL learner's now (`posttrain.rl.config.LearnerConfig`):
# an old config naming one gets a ConfigError naming the new key
_LEARNER_KEYS = ("ppo_epochs", "minibatches", "old_logprobs", "is_level", "is_cap", "max_resample_rounds", "pack",
                 "share_prompts")


@dataclasses.dataclass(frozen=True)
class GRPOFamily:
    """The settings of a GRPO-family algorithm (see the module docstring); subclasses set their defaults.
    `GRPOFamily(preset=NAME, **settings)` builds preset NAME (the default: grpo) with `settings`.

    preset: the algorithm whose defaults the other keys start from (grpo, dr_grpo, dapo, gspo, rloo); a key set
      beside it overrides that preset's value.
    advantage: the group advantage estimator (`posttrain.algorithms.advantages`): grpo (reward minus the group
      mean, over the group's std), dr_grpo (minus the mean, no std), rloo (minus the mean of the other G-1).
    ratio_level: the importance ratio that is clipped: per token (PPO/GRPO) or per sequence (GSPO: the
      length-normalised sequence ratio on every token of the sequence).
    epsilon_low, epsilon_high: the clip range [1 - epsilon_low, 1 + epsilon_high] of the ratio (DAPO's
      clip-higher raises epsilon_high).
    aggregation: how per-token losses reduce to the loss (`posttrain.algorithms.policy.aggregate`): token_mean
      (over all tokens, DAPO), seq_mean_token_mean (mean of each sequence's mean, GRPO), seq_mean_token_sum_norm
      (sum over N x max_tokens, Dr. GRPO).
    beta: weight of the per-token KL penalty to the reference model (the starting weights) added to the loss;
      0 = none (no reference model is kept).
    kl_estimator: the KL estimator of that penalty (`posttrain.algorithms.kl`): k1, k2 or k3 (used only when
      beta > 0).
    max_tokens: the constant length normaliser of seq_mean_token_sum_norm (the other aggregations ignore it);
      None = the rollout's completion budget (`rollout.max_new_tokens`, or a multi-turn trajectory's
      `rollout.max_total_tokens`).
    dynamic_sampling: drop groups whose completions all have the same reward (no advantage) and sample more,
      up to `learner.max_resample_rounds` x `rollout.batch_prompts` drops a step (DAPO).
    overlong_filtering: truncated completions (that hit the generation budget) get zero loss weight (DAPO).
    overlong_penalty: add DAPO's soft overlong punishment reward (`posttrain.rewards.length`, weight 1) unless
      `rewards.functions` already names `overlong_penalty`: 0 up to budget - L_cache tokens, then falling
      linearly to -1 at the budget.
    overlong_cache_fraction: that penalty's L_cache as a fraction of the completion budget, in (0, 1].
    """

    MOVED_KEYS: ClassVar[dict[str, str]] = {k: f"learner.{k}" for k in _LEARNER_KEYS}

    preset: PresetName = "grpo"
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    ratio_level: Literal["token", "sequence"] = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    aggregation: AggregationName = "token_mean"
    beta: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    max_tokens: int | None = None
    dynamic_sampling: bool = False
    overlong_filtering: bool = False
    overlong_penalty: bool = False
    overlong_cache_fraction: float = 0.2

    def __new__(cls, *args, **settings):
        # the family itself makes the class of the preset named (how the config's `algorithm` section is built)
        return object.__new__(get(PRESET_CLASSES, settings.get("preset", "grpo")) if cls is GRPOFamily else cls)

    def __post_init__(self):
        own = type(self).__dataclass_fields__["preset"].default
        if self.preset != own:
            raise ValueError(f"algorithm.preset={self.preset!r} for the {own!r} preset's class; "
                             f"GRPOFamily(preset={self.preset!r}, ...) builds that preset")
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
            raise ValueError(f"algorithm.overlong_cache_fraction must be in (0, 1], found {self.overlong_cache_fraction}")

    def replace(self, **overrides) -> GRPOFamily:
        """A copy with `overrides` (an unknown setting is a ValueError listing the accepted ones)."""
        names = [f.name for f in dataclasses.fields(self) if f.name != "preset"]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ValueError(f"unknown preset setting(s) {unknown}; accepted: {sorted(names)}")
        return dataclasses.replace(self, **overrides)


@dataclasses.dataclass(frozen=True)
class GRPO(GRPOFamily):
    """Shao et al. 2024 (DeepSeekMath): std-normalised advantages, per-sequence mean, k3 KL."""

    preset: PresetName = "grpo"
    aggregation: AggregationName = "seq_mean_token_mean"
    beta: float = 0.04


@dataclasses.dataclass(frozen=True)
class DrGRPO(GRPOFamily):
    """Liu et al. 2025 (Dr. GRPO): no std normalisation, constant length normaliser, no KL."""

    preset: PresetName = "dr_grpo"
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "dr_grpo"
    aggregation: AggregationName = "seq_mean_token_sum_norm"


@dataclasses.dataclass(frozen=True)
class DAPO(GRPOFamily):
    """Yu et al. 2025 (DAPO): clip-higher, token-level mean, dynamic sampling, overlong shaping, no KL."""

    preset: PresetName = "dapo"
    epsilon_high: float = 0.28
    dynamic_sampling: bool = True
    overlong_filtering: bool = True
    overlong_penalty: bool = True


@dataclasses.dataclass(frozen=True)
class GSPO(GRPOFamily):
    """Zheng et al. 2025 (GSPO): sequence-level (length-normalised) ratio with a tiny clip range."""

    preset: PresetName = "gspo"
    ratio_level: Literal["token", "sequence"] = "sequence"
    epsilon_low: float = 3e-4
    epsilon_high: float = 4e-4
    aggregation: AggregationName = "seq_mean_token_mean"


@dataclasses.dataclass(frozen=True)
class RLOO(GRPOFamily):
    """Ahmadian et al. 2024 (RLOO): leave-one-out baseline."""

    preset: PresetName = "rloo"
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "rloo"


# name -> the preset's class, and the preset with its defaults (instances are immutable: `replace` makes a copy)
PRESET_CLASSES: dict[str, type[GRPOFamily]] = {c.__dataclass_fields__["preset"].default: c
                                               for c in (GRPO, DrGRPO, DAPO, GSPO, RLOO)}
assert set(PRESET_CLASSES) == set(get_args(PresetName))
PRESETS: dict[str, GRPOFamily] = {name: c() for name, c in PRESET_CLASSES.items()}

# Preset keys that are keyword arguments of policy.policy_loss.
LOSS_KEYS = ("epsilon_low", "epsilon_high", "ratio_level", "aggregation", "beta", "kl_estimator", "max_tokens")

_NAMES = {
    id(ADVANTAGES): "advantage estimator",
    id(KL_ESTIMATORS): "KL estimator",
    id(AGGREGATIONS): "aggregation mode",
    id(PRESETS): "algorithm preset",
    id(PRESET_CLASSES): "algorithm preset",
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


def loss_kwargs(preset: GRPOFamily) -> dict:
    """The settings of a preset that are keyword arguments of ``policy_loss``."""
    return {k: getattr(preset, k) for k in LOSS_KEYS}
