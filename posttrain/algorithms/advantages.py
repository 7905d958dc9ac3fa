"""Group-relative advantage estimators (GRPO, Dr. GRPO, RLOO) over group-contiguous rewards.

Layout convention: ``rewards`` has shape ``[B * G]`` where the ``G`` completions of one
prompt are stored next to each other (``rewards[b * G:(b + 1) * G]`` belong to prompt ``b``).
Every estimator returns float32 advantages of shape ``[B * G]`` (one scalar per sequence,
to be broadcast over that sequence's tokens by the policy loss). GRPO's and Dr. GRPO's are one compiled program per
(batch size, group size), not one per array operation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["grpo_advantages", "dr_grpo_advantages", "rloo_advantages"]


def _grouped(rewards, group_size: int):
    rewards = np.asarray(rewards, dtype=np.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B*G], got shape {rewards.shape}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"len(rewards)={rewards.shape[0]} is not a multiple of group_size={group_size}"
        )
    return rewards.reshape(-1, group_size)


def grpo_advantages(rewards, group_size: int, eps: float = 1e-6):
    """GRPO outcome advantages (Shao et al. 2024, "DeepSeekMath", Sec. 4.1.2).

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` where mean and std are taken over the
    ``G`` completions of the same prompt and ``std`` is the population standard deviation
    (``ddof=0``). A group with identical rewards gets all-zero advantages.
    """
    return _grpo(_grouped(rewards, group_size), eps)


@functools.partial(jax.jit, static_argnums=(1,))
def _grpo(r, eps: float):
    mean = r.mean(axis=1, keepdims=True)
    std = r.std(axis=1, keepdims=True)  # population std (ddof=0)
    return ((r - mean) / (std + eps)).reshape(-1).astype(jnp.float32)


def dr_grpo_advantages(rewards, group_size: int):
    """Dr. GRPO advantages (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective").

    ``A_i = r_i - mean_g(r)``: GRPO without the per-group std normalisation, which the paper
    shows biases updates towards too-easy / too-hard questions.
    """
    return _dr_grpo(_grouped(rewards, group_size))


@jax.jit
def _dr_grpo(r):
    return (r - r.mean(axis=1, keepdims=True)).reshape(-1).astype(jnp.float32)


def rloo_advantages(rewards, group_size: int):
    """REINFORCE Leave-One-Out advantages (Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs").

    ``A_i = r_i - 1/(G-1) * sum_{j != i} r_j``, which equals ``G/(G-1) * (r_i - mean_g(r))``.
    Requires ``group_size >= 2``.
    """
    if group_size < 2:
        raise ValueError(f"rloo_advantages needs group_size >= 2, got {group_size}")
    r = jnp.asarray(_grouped(rewards, group_size))  # op by op: one fused program rounds differently here
    loo_mean = (r.sum(axis=1, keepdims=True) - r) / (group_size - 1)
    return (r - loo_mean).reshape(-1).astype(jnp.float32)
