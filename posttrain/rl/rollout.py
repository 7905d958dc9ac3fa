"""Rollouts: prompts -> G sampled completions each (current weights, in place) -> scored rewards, as plain data.

`Rollouts` holds only Python lists and numpy arrays, so the asynchronous fleet can later ship it between
processes unchanged: prompt and completion token ids, the sampler's per-token log-probs (the behaviour
policy's), finish reasons, texts, the reward total and each reward's value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from posttrain.sampling import Sampler, SamplingParams


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

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    def completion_lengths(self) -> np.ndarray:
        return np.array([len(c) for c in self.completion_ids], np.int32)

    def select_groups(self, keep: np.ndarray) -> "Rollouts":
        """Only the groups where `keep` [num_groups] is True."""
        idx = [i for i in range(len(self)) if keep[i // self.group_size]]
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        return Rollouts(
            group_size=self.group_size,
            record_index=pick(self.record_index),
            prompt_ids=pick(self.prompt_ids),
            completion_ids=pick(self.completion_ids),
            logprobs=pick(self.logprobs),
            finish_reasons=pick(self.finish_reasons),
            texts=pick(self.texts),
            prompts_text=pick(self.prompts_text),
            rewards=self.rewards[idx],
            per_reward={k: v[idx] for k, v in self.per_reward.items()},
            reward_stats=self.reward_stats,
        )

    @staticmethod
    def concat(parts: list["Rollouts"]) -> "Rollouts":
        first = parts[0]
        cat = lambda name: [x for p in parts for x in getattr(p, name)]  # noqa: E731
        return Rollouts(
            group_size=first.group_size,
            record_index=cat("record_index"),
            prompt_ids=cat("prompt_ids"),
            completion_ids=cat("completion_ids"),
            logprobs=cat("logprobs"),
            finish_reasons=cat("finish_reasons"),
            texts=cat("texts"),
            prompts_text=cat("prompts_text"),
            rewards=np.concatenate([p.rewards for p in parts]),
            per_reward={k: np.concatenate([p.per_reward[k] for p in parts]) for k in first.per_reward},
            reward_stats=Rollouts.merge_stats(parts),
        )

    @staticmethod
    def merge_stats(parts: list["Rollouts"]) -> dict[str, float]:
        """The parts' reward statistics together: counts (failures, timeouts) summed, means weighted by size."""
        out: dict[str, float] = {}
        sizes = [len(p) for p in parts]
        total = max(sum(sizes), 1)
        for key in dict.fromkeys(k for p in parts for k in p.reward_stats):
            vals = [(p.reward_stats[key], n) for p, n in zip(parts, sizes) if key in p.reward_stats]
            if key.endswith(("failures", "timeouts")):
                out[key] = float(sum(v for v, _ in vals))
            else:
                out[key] = float(sum(v * n for v, n in vals) / max(sum(n for _, n in vals), 1) if total else 0.0)
        return out


def encode_prompt(tokenizer, prompt: str | list[dict], *, chat: bool, system_prompt: str | None = None) -> list[int]:
    """Token ids of a prompt: chat messages through the chat template (with the generation prompt), or text."""
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return list(tokenizer.encode(prompt, add_special_tokens=True))


def prompt_text(prompt: str | list[dict]) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


def generate_rollouts(
    sampler: Sampler,
    records: list[dict[str, Any]],
    record_indices: list[int],
    prompt_ids: list[list[int]],
    params: SamplingParams,
    reward_runner,
) -> Rollouts:
    """Samples `params.n` completions per prompt and scores them with `reward_runner` (a `RewardRunner`)."""
    completions = sampler.generate(prompt_ids, params)
    g = params.n
    n = len(completions)
    rec_idx = [record_indices[c.prompt_index] for c in completions]
    texts = [c.text if c.text is not None else "" for c in completions]
    prompts = [prompt_text(records[i]["prompt"]) for i in rec_idx]
    fields: dict[str, list] = {}
    for key in records[record_indices[0]]:
        if key != "prompt":
            fields[key] = [records[i].get(key) for i in rec_idx]
    fields["completion_lengths"] = [len(c.token_ids) for c in completions]
    total, per_reward, stats = reward_runner.score(prompts, texts, fields)
    assert len(total) == n
    return Rollouts(
        group_size=g,
        record_index=rec_idx,
        prompt_ids=[list(prompt_ids[c.prompt_index]) for c in completions],
        completion_ids=[list(c.token_ids) for c in completions],
        logprobs=[list(c.logprobs) for c in completions],
        finish_reasons=[c.finish_reason for c in completions],
        texts=texts,
        prompts_text=prompts,
        rewards=np.asarray(total, np.float32),
        per_reward={k: np.asarray(v, np.float32) for k, v in per_reward.items()},
        reward_stats=dict(stats),
    )
