"""Held-out evaluation: greedy pass@1 and sampled pass@k (unbiased estimator) with a correctness reward."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from posttrain.rl.rollout import generate_rollouts
from posttrain.sampling import SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. 2021 (arXiv:2107.03374): 1 - C(n-c, k) / C(n, k), n samples, c correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(sampler, records: list[dict[str, Any]], prompt_ids: list[list[int]], reward_runner, *,
             correctness: str | None, max_new_tokens: int, k: int = 0, n_samples: int = 0,
             temperature: float = 1.0, seed: int = 0) -> dict[str, Any]:
    """Greedy pass@1 (`eval/accuracy`), mean reward and length; with k > 0 also pass@k from n_samples >= k draws.

    `correctness` names the reward whose value 1.0 means a correct answer (e.g. "math_answer"); without
    one, accuracy is reported as the fraction of completions with a positive total reward.
    """
    idx = list(range(len(records)))
    greedy = generate_rollouts(sampler, records, idx, prompt_ids,
                               SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), reward_runner)
    correct = _correct(greedy, correctness)
    out: dict[str, Any] = {
        "eval/accuracy": float(correct.mean()),
        "eval/reward_mean": float(greedy.rewards.mean()),
        "eval/completion_length": float(greedy.completion_lengths().mean()),
        "eval/num_prompts": len(records),
    }
    if k > 0:
        n = max(n_samples, k)
        sampled = generate_rollouts(
            sampler, records, idx, prompt_ids,
            SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=n, seed=seed), reward_runner,
        )
        c = _correct(sampled, correctness).reshape(len(records), n).sum(axis=1)
        out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(n, int(ci), k) for ci in c]))
        out["eval/pass@1_sampled"] = float(np.mean([pass_at_k(n, int(ci), 1) for ci in c]))
    out["_greedy"] = greedy
    return out


def _correct(rollouts, correctness: str | None) -> np.ndarray:
    if correctness is not None and correctness in rollouts.per_reward:
        return (rollouts.per_reward[correctness] >= 1.0).astype(np.float64)
    return (rollouts.rewards > 0).astype(np.float64)
