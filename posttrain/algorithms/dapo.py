"""Host-side (numpy) helpers for DAPO's dynamic sampling and overlong filtering.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale":
* dynamic sampling keeps only prompts whose group of G completions has non-identical
  rewards (accuracy strictly between 0 and 1), since equal rewards give zero advantage;
* overlong filtering gives zero loss weight to truncated completions.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["groups_with_signal", "expand_group_mask", "overlong_mask", "TRUNCATED_REASONS"]

# finish_reason values that mean "hit the generation budget" (vLLM/OpenAI use "length").
TRUNCATED_REASONS = frozenset({"length", "truncated", "max_tokens"})


def groups_with_signal(rewards, group_size: int, atol: float = 0.0) -> np.ndarray:
    """Return a bool array ``[B]``: True when group ``b`` (completions ``b*G .. b*G+G-1``) has
    rewards that are not all equal (``max - min > atol``), i.e. it yields a non-zero
    advantage. Groups of identical rewards -- all right or all wrong -- are False."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if group_size < 1 or r.size % group_size:
        raise ValueError(f"len(rewards)={r.size} is not a multiple of group_size={group_size}")
    g = r.reshape(-1, group_size)
    return (g.max(axis=1) - g.min(axis=1)) > atol


def expand_group_mask(group_mask, group_size: int) -> np.ndarray:
    """Repeat a per-group bool ``[B]`` to per-completion ``[B*G]`` (group-contiguous layout)."""
    return np.repeat(np.asarray(group_mask, dtype=bool), group_size)


def overlong_mask(finish_reasons_or_truncated: Sequence, truncated_reasons=TRUNCATED_REASONS) -> np.ndarray:
    """Per-completion loss weights ``[N]`` (float32): 0.0 for truncated completions, 1.0 otherwise.

    Accepts either a bool array (True = truncated) or a list of finish-reason strings, where a
    reason in ``truncated_reasons`` (default ``"length"``, ``"truncated"``, ``"max_tokens"``)
    counts as truncated. Multiply it into the token mask to apply DAPO overlong filtering.
    """
    values = np.asarray(finish_reasons_or_truncated).reshape(-1).tolist() if isinstance(
        finish_reasons_or_truncated, np.ndarray
    ) else list(finish_reasons_or_truncated)
    truncated = np.array(
        [(v in truncated_reasons) if isinstance(v, str) else bool(v) for v in values], dtype=bool
    )
    return np.where(truncated, 0.0, 1.0).astype(np.float32)
