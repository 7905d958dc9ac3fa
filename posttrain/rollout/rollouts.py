"""Rollouts: prompts -> G sampled completions each (current weights, in place) -> scored rewards, as plain data.

`Rollouts` holds only Python lists and numpy arrays, so the fleet ships it between processes unchanged
(and `to_json` puts it in a checkpoint): prompt and completion token ids, the sampler's per-token
log-probs (the behaviour policy's), finish reasons, texts, the reward total and each reward's value, and
per sample the group's uid (its position in the prompt stream), the policy version of the weights that
generated each token and the first and last of them (they differ when a fleet worker swapped weights between
decode segments: `fleet.swap=segment`).

Multi-turn rollouts (an `Agent`: tools or an environment, `posttrain.agent`) add per sample the completion
mask (1 on sampled tokens, 0 on appended tool results, observations and turn headers, whose log-probs are
0.0) and the trajectory's summary (messages, tool calls and results, turns, counts, finish reason). The
reward functions score the last assistant message (`texts`) and may take the whole conversation as the
`messages` field; an environment's reward (per-turn rewards summed plus its `reward(...)`) is the
`environment` reward, added to the total with weight 1.

Routing replay (a mixture of experts, `learner.routing_replay`): with `record_experts` the sampler records the
experts its router chose at every position it fed, and each sample carries them in `routed_experts`: an int8/int16
array [len(prompt) + len(completion) - 1, L_sparse, k], row t for the token at position t of prompt + completion
ids (the last token is never fed, so it has no row; multi-turn: appended tokens too). They travel with the
rollouts to the fleet's trainer and into checkpoints (`to_json`: compact base64 rows).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from posttrain import distributed
from posttrain.agent.rollout import Agent, AgentRollout
from posttrain.rollout.prompts import Prompt
from posttrain.sampling import Sampler, SamplingParams


COUNT_SUFFIXES = ("failures", "timeouts")  # reward statistics that are counts (summed); the others are means


@dataclasses.dataclass
class Rollouts:
    """N = B * G completions, group-contiguous (the G samples of one prompt in a row)."""

    group_size: int
    record_index: list[int]  # [N] index of the prompt record in the data set
    prompt_ids: list[list[int]]  # [N]
    completion_ids: list[list[int]]  # [N]
    logprobs: list[list[float]]  # [N] sampler log-probs (temperature-1 log-softmax of the raw logits)
    finish_reasons: list[str]  # [N] "stop" | "length"
    texts: list[str]  # [N] decoded completions
    prompts_text: list[str]  # [N]
    rewards: np.ndarray  # [N] weighted total
    per_reward: dict[str, np.ndarray]  # name -> [N]
    reward_stats: dict[str, float]
    uid: list[int] = dataclasses.field(default_factory=list)  # [N] the group's uid (prompt stream position)
    version_first: list[int] = dataclasses.field(default_factory=list)  # [N] policy version at the first token
    version_last: list[int] = dataclasses.field(default_factory=list)  # [N] ... and at the last token
    token_versions: list[list[int]] = dataclasses.field(default_factory=list)  # [N] per completion token
    completion_mask: list[list[int]] = dataclasses.field(default_factory=list)  # [N] multi-turn: 1 = sampled
    trajectories: list[dict] = dataclasses.field(default_factory=list)  # [N] multi-turn: `Trajectory.summary()`
    # [N] routing replay: [len(prompt) + len(completion) - 1, L_sparse, k] expert ids (module docstring)
    routed_experts: list[np.ndarray] = dataclasses.field(default_factory=list)

    _PER_SAMPLE = ("record_index", "prompt_ids", "completion_ids", "logprobs", "finish_reasons", "texts",
                   "prompts_text", "uid", "version_first", "version_last", "token_versions", "completion_mask", "trajectories",
                   "routed_experts")

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    def completion_lengths(self) -> np.ndarray:
        return np.array([len(c) for c in self.completion_ids], np.int32)

    def version_first_min(self) -> int:
        return int(min(self.version_first))

    def sampled_token_versions(self) -> np.ndarray:
        """The policy versions of every sampled token (appended multi-turn ids left out); without per-token
        versions (rollouts saved before they were kept), each sample's version_first per token."""
        out = []
        for i, ids in enumerate(self.completion_ids):
            v = self.token_versions[i] if self.token_versions else [self.version_first[i]] * len(ids)
            m = self.completion_mask[i] if self.completion_mask else None
            out.extend(x for j, x in enumerate(v) if m is None or m[j])
        return np.asarray(out, np.int64)

    def _pick(self, idx: list[int], reward_stats: dict[str, float]) -> "Rollouts":
        lists = {k: [getattr(self, k)[i] for i in idx] if getattr(self, k) else [] for k in self._PER_SAMPLE}
        return Rollouts(group_size=self.group_size, rewards=self.rewards[idx],
                        per_reward={k: v[idx] for k, v in self.per_reward.items()}, reward_stats=reward_stats, **lists)

    def groups(self) -> list["Rollouts"]:
        """One `Rollouts` per group: each keeps the means of the reward statistics and the first carries the
        failure and timeout counts, so `concat` (`merge_stats`) gives back the whole's statistics."""
        g = self.group_size
        rest = {k: (0.0 if k.endswith(COUNT_SUFFIXES) else v) for k, v in self.reward_stats.items()}
        return [self._pick(list(range(j * g, (j + 1) * g)), self.reward_stats if j == 0 else rest)
                for j in range(self.num_groups)]

    @staticmethod
    def concat(parts: list["Rollouts"]) -> "Rollouts":
        """The parts one after the other, with their reward statistics merged (`merge_stats`)."""
        first = parts[0]
        stats = Rollouts.merge_stats(parts)
        lists = {k: [x for p in parts for x in getattr(p, k)] for k in Rollouts._PER_SAMPLE}
        return Rollouts(group_size=first.group_size, rewards=np.concatenate([p.rewards for p in parts]),
                        per_reward={k: np.concatenate([p.per_reward[k] for p in parts]) for k in first.per_reward},
                        reward_stats=stats, **lists)

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self._PER_SAMPLE}
        out["routed_experts"] = [_array_to_json(a) for a in self.routed_experts]
        out.update(group_size=self.group_size, rewards=self.rewards.tolist(),
                   per_reward={k: v.tolist() for k, v in self.per_reward.items()}, reward_stats=dict(self.reward_stats))
        return out

    @staticmethod
    def from_json(d: dict) -> "Rollouts":
        lists = {k: list(d.get(k, [])) for k in Rollouts._PER_SAMPLE}
        lists["routed_experts"] = [_array_from_json(a) for a in lists["routed_experts"]]
        return Rollouts(group_size=int(d["group_size"]), rewards=np.asarray(d["rewards"], np.float32),
                        per_reward={k: np.asarray(v, np.float32) for k, v in d["per_reward"].items()},
                        reward_stats=dict(d["reward_stats"]), **lists)

    @staticmethod
    def merge_stats(parts: list["Rollouts"]) -> dict[str, float]:
        """The parts' reward statistics together: counts (failures, timeouts) summed, means weighted by size."""
        out: dict[str, float] = {}
        sizes = [len(p) for p in parts]
        total = max(sum(sizes), 1)
        for key in dict.fromkeys(k for p in parts for k in p.reward_stats):
            vals = [(p.reward_stats[key], n) for p, n in zip(parts, sizes) if key in p.reward_stats]
            if key.endswith(COUNT_SUFFIXES):
                out[key] = float(sum(v for v, _ in vals))
            else:
                out[key] = float(sum(v * n for v, n in vals) / max(sum(n for _, n in vals), 1) if total else 0.0)
        return out


def _array_to_json(a: np.ndarray) -> dict:
    """A small integer array as JSON: dtype, shape and its bytes in base64 (expert ids: 1-2 bytes each)."""
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def _array_from_json(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["b64"]), np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def prompt_text(prompt: str | list[dict]) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


def score_once(reward_runner, prompts: list[str], texts: list[str], fields: dict[str, list]):
    """`reward_runner.score(...)`; in a multi-host run process 0 scores (every process holds the same
    completions: the sampler's results are read whole on every process) and broadcasts the rewards, so reward
    code runs once per sample and every process trains on the same numbers (a user's reward that times out or
    is random cannot make the processes disagree)."""
    if not distributed.is_multiprocess():
        return reward_runner.score(prompts, texts, fields)
    result = None
    if distributed.is_primary():
        total, per_reward, stats = reward_runner.score(prompts, texts, fields)
        result = [np.asarray(total, np.float64).tolist(),
                  {k: np.asarray(v, np.float64).tolist() for k, v in per_reward.items()}, dict(stats)]
    total, per_reward, stats = distributed.broadcast_json(result)
    return (np.asarray(total, np.float32), {k: np.asarray(v, np.float32) for k, v in per_reward.items()},
            {k: float(v) for k, v in stats.items()})


def generate_rollouts(
    sampler: Sampler,
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
    """Samples `params.n` completions per prompt and scores them with `reward_runner` (a `RewardRunner`).

    `prompts`: `Prompt` items (a `PromptSet` or a selection of one): each gives its token ids, its images (image
    prompts: handed to its prefill, `Sampler.generate(images=...)`), its record (the reward fields) and its
    record index (`Rollouts.record_index`). With `uids` (one per prompt: the groups' stream positions), a group's
    samples are drawn from keys of (seed, uid), so they do not depend on which other groups share the call, and
    each sample is stamped with the sampler's weights version. `agent`: multi-turn rollouts (the sampler calls
    its trajectories at every turn end; see the module docstring). `progress` shows the sampler's progress bar.
    `between_segments`: newer weights between decode segments (`Sampler.generate`; partial rollouts): each
    token is stamped with the version that produced it. `record_experts` (a mixture of experts, routing replay):
    each sample's `routed_experts` (module docstring)."""
    prompts = list(prompts)
    rollout = AgentRollout(agent, [p.record for p in prompts], [p.ids for p in prompts],
                           [getattr(p, "where", None) for p in prompts]) if agent is not None else None
    try:
        return _scored(sampler, prompts, params, reward_runner, uids, rollout, progress, between_segments,
                       record_experts)
    finally:
        if rollout is not None:  # environment sessions still open (a failed call): closed
            rollout.close()


def _scored(sampler, prompts, params, reward_runner, uids, rollout, progress, between_segments,
            record_experts) -> Rollouts:
    """`generate_rollouts`' body: sample, score, gather."""
    completions, trajs = _sample(sampler, prompts, params, uids, rollout, progress, between_segments, record_experts)
    n = len(completions)
    records = [p.record for p in prompts]
    prompt_ids = [p.ids for p in prompts]
    recs = [records[c.prompt_index] for c in completions]
    if trajs is None:
        texts = [c.text if c.text is not None else "" for c in completions]
    else:
        texts = [t.final_text for t in trajs]
    # a record without a prompt (an environment's `reset` made the conversation): its first messages
    prompts_text = [prompt_text(r["prompt"] if "prompt" in r else trajs[k].first) for k, r in enumerate(recs)]
    fields: dict[str, list] = {key: [r.get(key) for r in recs] for key in records[0] if key != "prompt"}
    fields["completion_lengths"] = [len(c.token_ids) for c in completions]
    if trajs is not None:
        fields["messages"] = [t.messages for t in trajs]
    total, per_reward, stats = score_once(reward_runner, prompts_text, texts, fields)
    if trajs is not None:
        total, per_reward = _add_env_rewards(trajs, total, per_reward)
    version = int(getattr(sampler, "version", None) or 0)  # the weights' policy version (`Sampler.load_weights`)
    versions = [_token_versions(c, version) for c in completions]
    assert len(total) == n
    return Rollouts(
        group_size=params.n,
        record_index=[prompts[c.prompt_index].index for c in completions],
        prompt_ids=[list(prompt_ids[c.prompt_index]) for c in completions],
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
        routed_experts=[_recorded_experts(c, prompt_ids[c.prompt_index]) for c in completions] if record_experts
        else [],
    )


def _sample(sampler: Sampler, prompts: list[Prompt], params: SamplingParams, uids, rollout: AgentRollout | None,
            progress: bool, between_segments, record_experts: bool = False):
    """The sampler's completions of `prompts` (their ids, and their images when any has some; with
    `record_experts`, the experts routed to), and with an agent's `rollout` each completion's finished
    `Trajectory` (None without one)."""
    prompt_ids = [p.ids for p in prompts]
    kwargs: dict[str, Any] = {"progress": True} if progress else {}
    if between_segments is not None:
        kwargs["between_segments"] = between_segments
    if record_experts:
        kwargs["record_experts"] = True
    if any(p.images for p in prompts):
        kwargs["images"] = [p.images for p in prompts]
    if rollout is not None:
        kwargs.update(on_turn_end=rollout, max_len=_context_limit(sampler, prompt_ids, params, rollout.agent))
    completions = sampler.generate(prompt_ids, params, key_ids=uids, **kwargs)
    return completions, [rollout.finished(c) for c in completions] if rollout is not None else None


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


def _context_limit(sampler, prompt_ids, params: SamplingParams, agent: Agent) -> int | None:
    """The call's context limit for multi-turn rollouts: the longest prompt plus the trajectory budget (capped
    by the sampler's own limit); None without a budget (the sampler's limit)."""
    budget = agent.limits.max_total_tokens
    if not budget:
        return None
    limit = min(x for x in (getattr(sampler, "max_len", None), sampler.cfg.max_position_embeddings) if x)
    return min(max(len(p) for p in prompt_ids) + max(budget, params.max_new_tokens), limit)


def _add_env_rewards(trajs, total, per_reward):
    """The environment's reward per trajectory (when it gives one) as the `environment` reward, added to the total."""
    env = [t.env_reward() for t in trajs]
    if all(r is None for r in env):
        return total, per_reward
    values = np.asarray([0.0 if r is None else r for r in env], np.float32)
    return np.asarray(total, np.float32) + values, {**per_reward, "environment": values}


def correct(ro: Rollouts, correctness: str | None) -> np.ndarray:
    """1.0 per sample the correctness reward calls right (>= 1), or with no such reward, that scores above 0."""
    if correctness in ro.per_reward:
        return (ro.per_reward[correctness] >= 1.0).astype(np.float64)
    return (ro.rewards > 0).astype(np.float64)
