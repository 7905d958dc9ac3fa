"""Turns scored rollouts into the RL training batch: token arrays, completion masks, old log-probs.

Layout: prompts are left-padded into the first P columns and completions right-padded into the last
C columns, so every completion starts at column P. The loss then projects onto the vocabulary only at
the C completion positions (the prompt's logits are never computed). Entry j of the per-token arrays
[N, C] (`completion_mask`, `old_logp`) is about completion token j, predicted from column P-1+j.
P and C are rounded up to multiples of `multiple` so the jitted step compiles once per (P, C) bucket.
"""

from __future__ import annotations

import numpy as np

from posttrain.rl.rollout import Rollouts


def bucket_length(n: int, multiple: int = 16) -> int:
    """n rounded up to a multiple of `multiple` (at least one multiple)."""
    return max(multiple, -(-n // multiple) * multiple)


def build_rl_batch(rollouts: Rollouts, advantages: np.ndarray, *, seq_weights: np.ndarray | None = None,
                   pad_id: int = 0, multiple: int = 16) -> dict[str, np.ndarray]:
    """Arrays for the policy loss: input_ids/attention_mask/positions [N, P+C]; per-token [N, C]; advantages [N].

    `seq_weights` [N] scale each sequence's completion mask (0 drops it, e.g. DAPO overlong filtering).
    """
    n = len(rollouts)
    p = bucket_length(max(len(x) for x in rollouts.prompt_ids), multiple)
    c = bucket_length(max(len(x) for x in rollouts.completion_ids), multiple)
    input_ids = np.full((n, p + c), pad_id, np.int32)
    attention_mask = np.zeros((n, p + c), np.int32)
    completion_mask = np.zeros((n, c), np.float32)
    old_logp = np.zeros((n, c), np.float32)
    for i, (prompt, comp, lp) in enumerate(zip(rollouts.prompt_ids, rollouts.completion_ids, rollouts.logprobs)):
        input_ids[i, p - len(prompt): p] = prompt
        input_ids[i, p: p + len(comp)] = comp
        attention_mask[i, p - len(prompt): p + len(comp)] = 1
        completion_mask[i, : len(comp)] = 1.0
        old_logp[i, : len(comp)] = lp
    if seq_weights is not None:
        completion_mask *= np.asarray(seq_weights, np.float32)[:, None]
    positions = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0).astype(np.int32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "positions": positions,
        "completion_mask": completion_mask,
        "old_logp": old_logp,
        "advantages": np.asarray(advantages, np.float32),
    }


def completion_logprobs(full: np.ndarray, batch: dict[str, np.ndarray]) -> np.ndarray:
    """Slices [N, P+C-1] per-token log-probs (`Trainer.token_logprobs`) to the completion columns [N, C]."""
    c = batch["completion_mask"].shape[1]
    return np.asarray(full)[:, -c:]
