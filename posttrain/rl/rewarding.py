"""What an RL run samples and scores with, built from its config sections: the reward runner and the
rollout sampling parameters. One builder each, shared by the local run (`posttrain.rl.setup`) and the
fleet's rollout workers (`posttrain.rl.fleet.worker`), so both score and sample the same way."""

from __future__ import annotations

import dataclasses

from posttrain.algorithms.registry import GRPOFamily
from posttrain.rewards.length import overlong_penalty
from posttrain.rewards.runner import RewardRunner, RewardSpec
from posttrain.rl.config import RewardsSection, RolloutConfig
from posttrain.sampling.params import SamplingParams

__all__ = ["reward_runner", "rollout_sampling_params"]


def reward_runner(rewards: RewardsSection, rollout: RolloutConfig, preset: GRPOFamily) -> RewardRunner:
    """The configured rewards, plus DAPO's overlong penalty when the algorithm preset asks for it and the
    rewards do not already name it (its budget is the rollout's `max_new_tokens`, or a multi-turn trajectory's
    `completion_budget`)."""
    specs = [dataclasses.replace(RewardSpec.coerce(r.name), weight=r.weight, kwargs=dict(r.kwargs))
             for r in rewards.functions]
    if preset.overlong_penalty and not any(r.name == "overlong_penalty" for r in rewards.functions):
        budget = rollout.completion_budget
        cache = max(1, int(round(preset.overlong_cache_fraction * budget)))
        specs.append(RewardSpec(name="overlong_penalty", fn=overlong_penalty(budget, cache), weight=1.0))
    return RewardRunner(specs, timeout_s=rewards.timeout_s, failure_value=rewards.failure_value,
                        num_workers=rewards.num_workers, max_failed_calls=rewards.max_failed_steps)


def rollout_sampling_params(rollout: RolloutConfig, seed: int) -> SamplingParams:
    """Sampling of the `group_size` completions per prompt; `seed` is the run's seed (taken mod 2**32)."""
    return SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
                          top_k=rollout.top_k, n=rollout.group_size, stop_token_ids=rollout.stop_token_ids,
                          seed=seed % 2**32)
