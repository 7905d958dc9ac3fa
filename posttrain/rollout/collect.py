"""Scored rollouts: prompts -> G sampled completions each from a `Policy` (current weights, in place) -> their
rewards, as a `Rollouts` record (`posttrain.rollout.rollouts`: what the fields mean). One function, shared by RL
in-process and on the fleet's workers, the held-out and `posttrain eval` evaluations and on-policy distillation.

Rewards are scored once per sample: in a multi-host run process 0 scores and broadcasts (`score_once`). Rewards that
start early (the judge: `RewardRunner.early`) get each completion as soon as it is sampled, so their calls overlap
the decoding of the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from posttrain import distributed
from posttrain.agent.rollout import Agent
from posttrain.rollout.policy import Policy, Samples
from posttrain.rollout.prompts import Prompt
from posttrain.rollout.rollouts import Rollouts
from posttrain.sampling import SamplingParams

__all__ = ["generate_rollouts", "prompt_text", "score_once"]


def prompt_text(prompt: str | list[dict]) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


def _reward_input(record: dict, completion, traj=None) -> tuple[str, str, dict]:
    """What the rewards see of one completion: its prompt as text (a record without a prompt, whose conversation
    an environment's `reset` made: its first messages), its text (a trajectory's last assistant message), and its
    fields (the record's other columns, `completion_lengths`, and a trajectory's `messages`)."""
    prompt = prompt_text(record["prompt"] if "prompt" in record else traj.first)
    text = traj.final_text if traj is not None else (completion.text if completion.text is not None else "")
    fields = {key: value for key, value in record.items() if key != "prompt"}
    fields["completion_lengths"] = len(completion.token_ids)
    if traj is not None:
        fields["messages"] = traj.messages
    return prompt, text, fields


def score_once(reward_runner, prompts: list[str], texts: list[str], fields: dict[str, list], early=None):
    """`reward_runner.score(...)`; in a multi-host run process 0 scores (every process holds the same
    completions: the sampler's results are read whole on every process) and broadcasts the rewards, so reward
    code runs once per sample and every process trains on the same numbers (a user's reward that times out or
    is random cannot make the processes disagree)."""
    if not distributed.is_multiprocess():
        return reward_runner.score(prompts, texts, fields, early) if early is not None else \
            reward_runner.score(prompts, texts, fields)
    result = None
    if distributed.is_primary():
        total, per_reward, stats = reward_runner.score(prompts, texts, fields)
        result = [np.asarray(total, np.float64).tolist(),
                  {k: np.asarray(v, np.float64).tolist() for k, v in per_reward.items()}, dict(stats)]
    total, per_reward, stats = distributed.broadcast_json(result)
    return (np.asarray(total, np.float32), {k: np.asarray(v, np.float32) for k, v in per_reward.items()},
            {k: float(v) for k, v in stats.items()})


def generate_rollouts(
    policy: Policy,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    reward_runner,
    *,
    uids: list[int] | None = None,
    agent: Agent | None = None,
    progress: bool = False,
    between_segments=None,
    record_experts: bool = False,
) -> Rollouts:
    """Samples `params.n` completions per prompt with `policy` and scores them with `reward_runner` (a
    `RewardRunner`).

    `prompts`: `Prompt` items (a `PromptSet` or a selection of one): each gives its token ids, its images (image
    prompts: handed to its prefill), its record (the reward fields) and its record index (`Rollouts.record_index`).
    With `uids` (one per prompt: the groups' stream positions), a group's samples are drawn from keys of (seed, uid),
    so they do not depend on which other groups share the call, and each sample is stamped with the policy's weights
    version. `agent`: multi-turn rollouts (the sampler calls its trajectories at every turn end; see the module
    docstring of `posttrain.rollout.rollouts`), each sequence's context limited to the longest prompt plus the
    trajectory budget. `progress` shows the sampler's progress bar. `between_segments`: newer weights between decode
    segments (partial rollouts): each token is stamped with the version that produced it. `record_experts` (a mixture
    of experts, routing replay): each sample's `routed_experts`. Early rewards: see the module docstring."""
    prompts = list(prompts)
    max_len = None if agent is None else _context_limit(policy, prompts, params, agent)
    early = reward_runner.early() if hasattr(reward_runner, "early") and not distributed.is_multiprocess() else None
    samples = policy.sample(prompts, params, agent=agent, key_ids=uids, progress=progress, max_len=max_len,
                            between_segments=between_segments, record_experts=record_experts,
                            on_finish=None if early is None else _early_feed(early, prompts, params.n))
    try:
        return _scored(samples, prompts, params, reward_runner, uids, policy.version, record_experts, early)
    finally:
        samples.close()  # environment sessions still open (a failed call): closed


def _early_feed(early, prompts: list[Prompt], n: int):
    """`Policy.sample`'s `on_finish`: a finished completion's reward inputs to the early rewards (a problem here only
    leaves the completion to be asked again when the batch is scored)."""
    def on_finish(c, traj) -> None:
        try:
            early.add(c.prompt_index * n + c.sample_index, *_reward_input(prompts[c.prompt_index].record, c, traj))
        except Exception:  # noqa: BLE001, S110 - never the sampler's problem
            pass

    return on_finish


def _scored(samples: Samples, prompts: list[Prompt], params: SamplingParams, reward_runner, uids,
            version: int | None, record_experts: bool, early=None) -> Rollouts:
    """`generate_rollouts`' scoring: the rewards of `samples` and the `Rollouts` record of them."""
    completions, trajs = samples.completions, samples.trajectories
    inputs = [_reward_input(prompts[c.prompt_index].record, c, trajs[k] if trajs is not None else None)
              for k, c in enumerate(completions)]
    prompts_text, texts = [x[0] for x in inputs], [x[1] for x in inputs]
    fields: dict[str, list] = {key: [x[2].get(key) for x in inputs] for key in (inputs[0][2] if inputs else {})}
    total, per_reward, stats = score_once(reward_runner, prompts_text, texts, fields, early)
    if trajs is not None:
        total, per_reward = _add_env_rewards(trajs, total, per_reward)
    version = int(version or 0)  # the weights' policy version (`Policy.swap_weights`)
    versions = [_token_versions(c, version) for c in completions]
    assert len(total) == len(completions)
    return Rollouts(
        group_size=params.n,
        record_index=[prompts[c.prompt_index].index for c in completions],
        prompt_ids=[list(prompts[c.prompt_index].ids) for c in completions],
        completion_ids=[list(c.token_ids) for c in completions],
        logprobs=[list(c.logprobs) for c in completions],
        finish_reasons=[c.finish_reason for c in completions] if trajs is None else [t.summary()["finish_reason"]
                                                                                     for t in trajs],
        texts=texts,
        prompts_text=prompts_text,
        rewards=np.asarray(total, np.float32),
        per_reward={k: np.asarray(v, np.float32) for k, v in per_reward.items()},
        reward_stats=dict(stats),
        uid=[uids[c.prompt_index] for c in completions] if uids is not None else [],
        version_first=[min(v, default=version) for v in versions],  # versions only grow within a call
        version_last=[max(v, default=version) for v in versions],
        token_versions=versions,
        completion_mask=[] if trajs is None else [list(c.mask) for c in completions],
        trajectories=[] if trajs is None else [t.summary() for t in trajs],
        routed_experts=[_recorded_experts(c, prompts[c.prompt_index].ids) for c in completions] if record_experts
        else [],
    )


def _context_limit(policy: Policy, prompts: list[Prompt], params: SamplingParams, agent: Agent) -> int | None:
    """The call's context limit for multi-turn rollouts: the longest prompt plus the trajectory budget (capped
    by the policy's own limit); None without a budget (the policy's limit)."""
    budget = agent.limits.max_total_tokens
    if not budget:
        return None
    return min(max(len(p.ids) for p in prompts) + max(budget, params.max_new_tokens), policy.context)


def _recorded_experts(c, prompt_ids) -> np.ndarray:
    """A completion's recorded experts [len(prompt) + len(completion) - 1, L_sparse, k], checked for that length."""
    experts = getattr(c, "routed_experts", None)
    want = len(prompt_ids) + len(c.token_ids) - 1
    if experts is None or np.shape(experts)[0] != want:
        got = None if experts is None else np.shape(experts)
        raise RuntimeError(f"routing replay: the sampler recorded experts of shape {got} for a sequence of "
                           f"{len(prompt_ids)} prompt and {len(c.token_ids)} completion tokens ({want} positions fed)")
    return np.asarray(experts)


def _token_versions(c, default: int) -> list[int]:
    """Per token of a completion, the version that produced it (`default` where the sampler kept none)."""
    if not c.versions:
        return [default] * len(c.token_ids)
    return [default if v is None else int(v) for v in c.versions]


def _add_env_rewards(trajs, total, per_reward):
    """The environment's reward per trajectory (when it gives one) as the `environment` reward, added to the total."""
    env = [t.env_reward() for t in trajs]
    if all(r is None for r in env):
        return total, per_reward
    values = np.asarray([0.0 if r is None else r for r in env], np.float32)
    return np.asarray(total, np.float32) + values, {**per_reward, "environment": values}


