"""Turns scored rollouts into the RL training batch: right-padded token arrays, completion masks, old log-probs.

Alignment follows `posttrain.algorithms.sft.token_logprobs`: its entry t is log p(token t+1 | tokens <= t),
so `completion_mask[:, t]` is 1 when token t+1 is a completion token and `old_logp[:, t]` holds the
sampler's log-prob of that token. Sequence lengths are rounded up to a few buckets so the jitted
step compiles once per bucket, not once per batch.
"""

from __future__ import annotations

import numpy as np

from posttrain.rl.rollout import Rollouts


def bucket_length(n: int, minimum: int = 32, cap: int | None = None) -> int:
    """The smallest power of two >= max(n, minimum), but not above `cap` (when n <= cap)."""
    size = minimum
    while size < n:
        size *= 2
    if cap is not None and n <= cap:
        size = min(size, cap)
    return size


def build_rl_batch(rollouts: Rollouts, advantages: np.ndarray, *, seq_weights: np.ndarray | None = None,
                   pad_id: int = 0, max_len: int | None = None) -> dict[str, np.ndarray]:
    """Arrays [N, T] (and [N, T-1] for per-token targets) for the policy loss; seq_weights [N] scale masks."""
    n = len(rollouts)
    lengths = [len(p) + len(c) for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids)]
    t = bucket_length(max(lengths), cap=max_len)
    input_ids = np.full((n, t), pad_id, np.int32)
    attention_mask = np.zeros((n, t), np.int32)
    completion_mask = np.zeros((n, t - 1), np.float32)
    old_logp = np.zeros((n, t - 1), np.float32)
    for i, (p, c, lp) in enumerate(zip(rollouts.prompt_ids, rollouts.completion_ids, rollouts.logprobs)):
        seq = list(p) + list(c)
        input_ids[i, : len(seq)] = seq
        attention_mask[i, : len(seq)] = 1
        start = len(p) - 1  # entry predicting the first completion token
        completion_mask[i, start : start + len(c)] = 1.0
        old_logp[i, start : start + len(c)] = lp
    if seq_weights is not None:
        completion_mask *= np.asarray(seq_weights, np.float32)[:, None]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy(),
        "completion_mask": completion_mask,
        "old_logp": old_logp,
        "advantages": np.asarray(advantages, np.float32),
    }
