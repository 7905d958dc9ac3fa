"""`Rollouts`: G sampled, scored completions per prompt as plain data (made by `posttrain.rollout.collect`).

`Rollouts` holds only Python lists and numpy arrays (this module imports neither JAX nor the sampler, so the
dispatcher and the fleet's bookkeeping use it freely), so the fleet ships it between processes unchanged
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

import numpy as np

__all__ = ["COUNT_SUFFIXES", "Rollouts", "correct", "per_sample_fields"]

COUNT_SUFFIXES = ("failures", "timeouts", "skipped")  # reward statistics that are counts (summed); the others are means


#: a `Rollouts` field with one entry per sample (`per_sample_fields`: what selecting, joining and saving carry)
PER_SAMPLE = {"per_sample": True}


def _samples(**kw):
    """A per-sample field (one entry per sample; `[]` when the rollouts do not have it)."""
    return dataclasses.field(metadata=PER_SAMPLE, **kw)


@dataclasses.dataclass
class Rollouts:
    """N = B * G completions, group-contiguous (the G samples of one prompt in a row)."""

    group_size: int
    record_index: list[int] = _samples()  # [N] index of the prompt record in the data set
    prompt_ids: list[list[int]] = _samples()  # [N]
    completion_ids: list[list[int]] = _samples()  # [N]
    logprobs: list[list[float]] = _samples()  # [N] sampler log-probs (temperature-1 log-softmax of the raw logits)
    finish_reasons: list[str] = _samples()  # [N] "stop" | "length"
    texts: list[str] = _samples()  # [N] decoded completions
    prompts_text: list[str] = _samples()  # [N]
    rewards: np.ndarray  # [N] weighted total
    per_reward: dict[str, np.ndarray]  # name -> [N]
    reward_stats: dict[str, float]
    uid: list[int] = _samples(default_factory=list)  # [N] the group's uid (prompt stream position)
    version_first: list[int] = _samples(default_factory=list)  # [N] policy version at the first token
    version_last: list[int] = _samples(default_factory=list)  # [N] ... and at the last token
    token_versions: list[list[int]] = _samples(default_factory=list)  # [N] per completion token
    completion_mask: list[list[int]] = _samples(default_factory=list)  # [N] multi-turn: 1 = sampled
    trajectories: list[dict] = _samples(default_factory=list)  # [N] multi-turn: `Trajectory.summary()`
    # [N] routing replay: [len(prompt) + len(completion) - 1, L_sparse, k] expert ids (module docstring)
    routed_experts: list[np.ndarray] = _samples(default_factory=list)

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
        lists = {k: [getattr(self, k)[i] for i in idx] if getattr(self, k) else [] for k in per_sample_fields()}
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
        lists = {k: [x for p in parts for x in getattr(p, k)] for k in per_sample_fields()}
        return Rollouts(group_size=first.group_size, rewards=np.concatenate([p.rewards for p in parts]),
                        per_reward={k: np.concatenate([p.per_reward[k] for p in parts]) for k in first.per_reward},
                        reward_stats=stats, **lists)

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in per_sample_fields()}
        out["routed_experts"] = [_array_to_json(a) for a in self.routed_experts]
        out.update(group_size=self.group_size, rewards=self.rewards.tolist(),
                   per_reward={k: v.tolist() for k, v in self.per_reward.items()}, reward_stats=dict(self.reward_stats))
        return out

    @staticmethod
    def from_json(d: dict) -> "Rollouts":
        lists = {k: list(d.get(k, [])) for k in per_sample_fields()}
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


def per_sample_fields() -> tuple[str, ...]:
    """The names of `Rollouts`' per-sample fields, in order (declared once, with `PER_SAMPLE`)."""
    return tuple(f.name for f in dataclasses.fields(Rollouts) if f.metadata.get("per_sample"))


def _array_to_json(a: np.ndarray) -> dict:
    """A small integer array as JSON: dtype, shape and its bytes in base64 (expert ids: 1-2 bytes each)."""
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def _array_from_json(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["b64"]), np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def correct(ro: Rollouts, correctness: str | None) -> np.ndarray:
    """1.0 per sample the correctness reward calls right (>= 1), or with no such reward, that scores above 0."""
    if correctness in ro.per_reward:
        return (ro.per_reward[correctness] >= 1.0).astype(np.float64)
    return (ro.rewards > 0).astype(np.float64)
