"""Reward functions for RL post-training (math answer, format, overlong length) and the
fault-tolerant process-pool reward runner."""

from posttrain.rewards.format import DEFAULT_FORMAT_PATTERN, format_reward
from posttrain.rewards.length import overlong_penalty, soft_overlong_punishment
from posttrain.rewards.math_answer import extract_answer, extract_gold, math_answer
from posttrain.rewards.loading import BUILTIN_REWARDS, RewardSpec, load_reward
from posttrain.rewards.runner import RewardRunner

__all__ = [
    "math_answer",
    "extract_answer",
    "extract_gold",
    "format_reward",
    "DEFAULT_FORMAT_PATTERN",
    "overlong_penalty",
    "soft_overlong_punishment",
    "RewardSpec",
    "RewardRunner",
    "load_reward",
    "BUILTIN_REWARDS",
]
