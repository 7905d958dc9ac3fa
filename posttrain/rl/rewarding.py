"""What an RL run samples and scores with, built from its config sections: the reward runner, the rollout sampling
parameters and the agent's tools and environment (checked before any model loads). One builder each, shared by the
local run (`posttrain.rl.setup`) and the fleet's rollout workers (`posttrain.rl.fleet.worker`), so both score and
sample the same way."""

from __future__ import annotations

import dataclasses

from posttrain import distributed
from posttrain.agent.setup import agent_enabled, load_agent_parts
from posttrain.algorithms.registry import GRPOFamily
from posttrain.config import ConfigError
from posttrain.rewards.length import overlong_penalty
from posttrain.rewards.runner import RewardRunner, RewardSpec
from posttrain.rl.config import FleetConfig, PromptData, RewardsSection, RolloutConfig
from posttrain.sampling.params import SamplingParams
from posttrain.serve.local import serve_judges

__all__ = ["agent_parts", "reward_runner", "rollout_sampling_params"]


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
    runner = RewardRunner(specs, timeout_s=rewards.timeout_s, failure_value=rewards.failure_value,
                          num_workers=rewards.num_workers, max_failed_calls=rewards.max_failed_steps)
    try:  # a judge given as a local checkpoint (`kwargs.model`, no `url`): opened as a Policy and served in-process
        serve_judges(runner)
    except BaseException:
        runner.close()
        raise
    return runner


def rollout_sampling_params(rollout: RolloutConfig, seed: int) -> SamplingParams:
    """Sampling of the `group_size` completions per prompt; `seed` is the run's seed (taken mod 2**32)."""
    return SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
                          top_k=rollout.top_k, n=rollout.group_size, stop_token_ids=rollout.stop_token_ids,
                          seed=seed % 2**32)


def agent_parts(rollout: RolloutConfig, fleet: FleetConfig, data: PromptData):
    """The tools and environment of multi-turn rollouts (None: single-turn), checked before the model loads."""
    if not agent_enabled(rollout):
        return None
    if distributed.is_multiprocess() and not (fleet.enabled and not data.eval):
        raise ConfigError("rollout.tools: a multi-process trainer runs multi-turn rollouts only on the fleet "
                          "(fleet.workers) and without data.eval (sampling in-process, every process would run "
                          "the tools and could read different results)")
    return load_agent_parts(rollout)
