"""`posttrain eval --environment verifiers:NAME_OR_FILE`: a model evaluated on a verifiers environment's own eval split
(its train split when it has none), the environment running its rollouts and its rubric scoring them.

The model is opened as a `Policy` and served in-process (`posttrain.serve.local.serve_policy`); the environment
(`posttrain.rollout.verifiers_env.VerifiersEnvironment`, in its worker process) runs one greedy rollout of each row
and, with `--n`, n sampled ones at `--temperature`. The summary reports the rubric's reward and each of its metrics,
greedy (`eval/reward_mean`, `eval/rubric/NAME`) and sampled (`eval/reward_mean_sampled`,
`eval/rubric/NAME_sampled`), the greedy accuracy and the sampled pass@k counting a reward >= 1 as correct, and the
environment's failures and refused turns. One JSONL row per problem: the prompt, the greedy and sampled
conversations with their reward and metrics.
"""

from __future__ import annotations

import numpy as np

from posttrain.config import ConfigError
from posttrain.eval.evaluate import pass_at_k
from posttrain.models.prompt_format import PromptStyle
from posttrain.rollout.policy import Policy
from posttrain.rollout.rollouts import Rollouts
from posttrain.rollout.verifiers_env import VerifiersEnvironment
from posttrain.sampling import SamplingParams
from posttrain.serve.local import SERVED_NAME, serve_policy

__all__ = ["evaluate_verifiers"]


def _means(ro: Rollouts, suffix: str) -> dict[str, float]:
    out = {f"eval/reward_mean{suffix}": float(np.mean(ro.rewards)) if len(ro) else 0.0}
    for name, values in ro.per_reward.items():
        if name.startswith("rubric/"):
            out[f"eval/{name}{suffix}"] = float(np.mean(values))
    return out


def _rows(records: list[dict], greedy: Rollouts, sampled: Rollouts | None, n: int) -> list[dict]:
    def sample(ro: Rollouts, i: int) -> dict:
        t = ro.trajectories[i]
        return {"text": ro.texts[i], "reward": float(ro.rewards[i]),
                "metrics": {k.removeprefix("rubric/"): float(v[i]) for k, v in ro.per_reward.items()
                            if k.startswith("rubric/")}, "trajectory": t}

    return [{"prompt": r.get("prompt"), "answer": r.get("answer"), "greedy": sample(greedy, i),
             "samples": [sample(sampled, i * n + j) for j in range(n)] if sampled is not None else []}
            for i, r in enumerate(records)]


def evaluate_verifiers(cfg) -> tuple[dict, list[dict]]:
    """(summary, per-problem rows) of `cfg` (an `EvalConfig` whose `environment` is `verifiers:...`)."""
    try:
        env = VerifiersEnvironment.open(cfg.environment, cfg.environment_args, key="--environment")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        records = env.records("eval")
        records = records[: cfg.limit] if cfg.limit else records
        indices = list(range(len(records)))
        policy = Policy.open(cfg.model, dtype=cfg.dtype, max_slots=cfg.max_slots)
        prompts = policy.encode(records, style=PromptStyle(chat=True, system_prompt=cfg.system_prompt))
        server = serve_policy(policy, slots=cfg.max_slots, system_prompt=cfg.system_prompt)
        url = f"{server.url}/v1"
        try:
            greedy, counts = env.rollouts(prompts, indices, SamplingParams(max_new_tokens=cfg.max_new_tokens,
                                                                           temperature=0.0, n=1), url, SERVED_NAME,
                                          split="eval")
            sampled = None
            if cfg.n:
                sampled, more = env.rollouts(prompts, indices, SamplingParams(
                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, n=cfg.n),
                    url, SERVED_NAME, split="eval")
                counts = {k: v + more.get(k, 0.0) for k, v in counts.items()}
        finally:
            server.stop()
    finally:
        env.close()
    summary = {"eval/num_prompts": len(records), "eval/accuracy": float(np.mean(greedy.rewards >= 1.0))
               if len(records) else 0.0} | _means(greedy, "") | {f"eval/{k.split('/')[-1]}": v for k, v in
                                                                 counts.items()}
    if sampled is not None:
        summary |= _means(sampled, "_sampled")
        c = (sampled.rewards >= 1.0).reshape(len(records), cfg.n).sum(axis=1)
        for k in cfg.k:
            summary[f"eval/pass@{k}"] = float(np.mean([pass_at_k(cfg.n, int(ci), k) for ci in c]))
    return summary, _rows(records, greedy, sampled, cfg.n)
