"""What a step's rollouts say, as numbers: per-sample correctness, each group's pass rate (what curation is
fed) and the rollout metrics logged with every RL step (rewards, lengths, truncation, groups with signal)."""

from __future__ import annotations

import numpy as np

from posttrain.algorithms import dapo
from posttrain.rollout.rollouts import Rollouts, correct

__all__ = ["agent_metrics", "pass_rates", "rollout_metrics"]


def pass_rates(ro: Rollouts, correctness: str | None) -> dict[int, float]:
    """uid -> fraction of the group's samples that are correct (for curation)."""
    c = correct(ro, correctness)
    g = ro.group_size
    return {int(ro.uid[j * g]): float(c[j * g:(j + 1) * g].mean()) for j in range(ro.num_groups)}


def rollout_metrics(ro: Rollouts, correctness: str | None) -> dict[str, float]:
    """reward/..., completion/..., groups/..., accuracy (with a correctness reward) and the reward workers'
    failure and timeout counts of a step's rollouts."""
    lengths = ro.completion_lengths()
    m = {
        "reward/mean": float(ro.rewards.mean()),
        "reward/std": float(ro.rewards.std()),
        "completion/length_mean": float(lengths.mean()),
        "completion/length_max": float(lengths.max()),
        "completion/truncated_fraction": float(np.mean([f == "length" for f in ro.finish_reasons])),
        "groups/kept": float(ro.num_groups),
        "groups/with_signal": float(dapo.groups_with_signal(ro.rewards, ro.group_size).sum()),
    }
    for name, vals in ro.per_reward.items():
        m[f"reward/{name}"] = float(vals.mean())
    if correctness in ro.per_reward:
        m["accuracy"] = float(correct(ro, correctness).mean())
    for k, v in ro.reward_stats.items():
        if k.endswith(("failures", "timeouts")):
            m[k] = float(v)
    if ro.trajectories:
        m |= agent_metrics(ro.trajectories)
    return m


def agent_metrics(trajectories: list[dict]) -> dict[str, float]:
    """Multi-turn rollouts: assistant turns, tool calls and environment failures per trajectory (means), failed
    tool calls and tool seconds (sums over the step), and the fraction of trajectories ended because an append
    did not fit."""
    t = trajectories
    return {"agent/turns_mean": float(np.mean([x["turns"] for x in t])),
            "agent/tool_calls_mean": float(np.mean([x["num_tool_calls"] for x in t])),
            "agent/env_errors": float(np.mean([x.get("env_errors", 0) for x in t])),
            "agent/tool_errors": float(sum(x["tool_errors"] for x in t)),
            "agent/tool_seconds": float(sum(x["tool_seconds"] for x in t)),
            "agent/truncated_frac": float(np.mean([x["finish_reason"] == "truncated" for x in t]))}
