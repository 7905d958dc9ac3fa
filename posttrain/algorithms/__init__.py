"""GRPO-family RL algorithms: advantage estimators, KL estimators, policy losses, DAPO helpers, registries."""

from posttrain.algorithms.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from posttrain.algorithms.dapo import expand_group_mask, groups_with_signal, overlong_mask
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.policy import aggregate, entropy_from_logits, policy_loss
from posttrain.algorithms.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    PRESETS,
    get,
    get_preset,
    loss_kwargs,
)

__all__ = [
    "grpo_advantages",
    "dr_grpo_advantages",
    "rloo_advantages",
    "kl_penalty",
    "aggregate",
    "policy_loss",
    "entropy_from_logits",
    "groups_with_signal",
    "expand_group_mask",
    "overlong_mask",
    "ADVANTAGES",
    "KL_ESTIMATORS",
    "AGGREGATIONS",
    "PRESETS",
    "get",
    "get_preset",
    "loss_kwargs",
]
