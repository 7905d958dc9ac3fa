"""The one evaluator: greedy pass@1, sampled pass@k (unbiased estimator) and maj@k with a correctness reward.

Used by RL's periodic held-out evaluation (`posttrain.rl.steps.evaluate`), by `posttrain eval` and by the demo. A
problem's samples are drawn once (n >= max k) and every pass@k / maj@k is the exact expectation over the
k-subsets of those n samples, so the figures do not depend on the order the samples came in:

    pass@k = 1 - C(n - c, k) / C(n, k)                       (Chen et al. 2021, arXiv:2107.03374)
    maj@k  = E over k-subsets S [ 1{the most frequent answer in S is correct} ]
             (Wang et al. 2023, self-consistency; ties among the top answers are broken uniformly at
             random, so a tie of t answers one of which is correct counts 1/t; samples without an
             extracted answer do not vote, and a subset where none has an answer counts 0)

Answers are compared by their key (`answer_key`): the extracted final answer of the correctness reward
(`math_answer`: exact numbers compare as fractions, so "1,000" and "1000.0" are one answer), or the
stripped completion text for rewards without an extractor.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from posttrain.rewards.math_answer import extract_answer, to_number
from posttrain.rewards.reasoning_gym import extract
from posttrain.rollout.collect import generate_rollouts
from posttrain.rollout.policy import Policy
from posttrain.rollout.prompts import PromptSet
from posttrain.rollout.rollouts import correct
from posttrain.sampling import SamplingParams

__all__ = ["pass_at_k", "maj_at_k", "answer_key", "evaluate", "per_problem"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. 2021 (arXiv:2107.03374): 1 - C(n-c, k) / C(n, k), n samples, c correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def maj_at_k(answers: Sequence[Any], correct: Sequence[bool], k: int) -> float:
    """Expected majority-vote accuracy of a random k-subset of n samples (see the module docstring).

    answers[i]: sample i's answer key (None = no answer: it does not vote); correct[i]: whether it is right
    (samples with the same key must agree). Exact, by dynamic programming over the answer classes: a state is
    (samples taken, top count, answers tied at the top, whether the correct answer is among them), weighted
    by the number of subsets reaching it; O(classes * k^3) at worst, no enumeration of the C(n, k) subsets.
    """
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n (n={n} samples), found k={k}")
    counts = Counter(a for a in answers if a is not None)
    right = {a for a, ok in zip(answers, correct) if a is not None and ok}
    none = n - sum(counts.values())
    # state (taken, top, ties, correct_at_top) -> number of subsets
    states: dict[tuple[int, int, int, bool], int] = {(x, 0, 0, False): math.comb(none, x)
                                                     for x in range(min(none, k) + 1)}
    for answer, c in counts.items():
        is_right = answer in right
        nxt: dict[tuple[int, int, int, bool], int] = {}
        for (taken, top, ties, ok), w in states.items():
            for x in range(min(c, k - taken) + 1):
                if x == 0 or x < top:
                    key = (taken + x, top, ties, ok)
                elif x == top:
                    key = (taken + x, top, ties + 1, ok or is_right)
                else:
                    key = (taken + x, x, 1, is_right)
                nxt[key] = nxt.get(key, 0) + w * math.comb(c, x)
        states = nxt
    total = sum(w * (1.0 / ties if ok else 0.0) for (taken, top, ties, ok), w in states.items() if taken == k and top)
    return total / math.comb(n, k)


def _math_key(text: str):
    a = extract_answer(text)
    if a is None:
        return None
    num = to_number(a)
    return str(num) if num is not None else a.strip()


def _reasoning_gym_key(text: str):
    a = extract(text)
    return None if a is None else str(a).strip()


#: correctness reward name -> its answer extractor (the key majority voting groups by)
ANSWER_KEYS: dict[str, Callable[[str], Any]] = {"math_answer": _math_key, "reasoning_gym": _reasoning_gym_key}


def answer_key(text: str, correctness: str | None):
    """The answer of a completion that majority voting compares (None = no answer)."""
    fn = ANSWER_KEYS.get(correctness or "")
    if fn is not None:
        return fn(text)
    return text.strip() or None


def _ks(k: int | Sequence[int]) -> list[int]:
    ks = [int(k)] if isinstance(k, (int, np.integer)) else [int(x) for x in k]
    ks = sorted({x for x in ks if x > 0})
    return ks


def evaluate(policy: Policy, prompts: PromptSet, reward_runner, *, correctness: str | None, max_new_tokens: int,
             k: int | Sequence[int] = 0, n_samples: int = 0, temperature: float = 1.0, top_p: float = 1.0,
             seed: int = 0, greedy: bool = True, progress: bool = False, agent=None) -> dict[str, Any]:
    """Greedy pass@1 (`eval/accuracy`), mean reward and length of `prompts` (a `PromptSet`: each problem's ids,
    images and record) sampled from `policy`; with k > 0 (an int or a list) also, from n = max(n_samples, k) draws
    per problem at `temperature`: `eval/pass@1_sampled`, `eval/pass@k` and `eval/maj@k` for every k > 1.

    `correctness` names the reward whose value 1.0 means a correct answer (e.g. "math_answer"); without
    one, a completion is correct when its total reward is positive. Besides the metrics, the dict holds
    `_greedy` and `_sampled` (the `Rollouts`, or None) for sample logs and `per_problem`. `agent`: multi-turn
    rollouts with its tools or environment (`posttrain.agent`), then `eval/turns_mean` and `eval/tool_calls_mean`.
    """
    out: dict[str, Any] = {"eval/num_prompts": len(prompts)}
    g = None
    if greedy:
        g = generate_rollouts(policy, prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
                              reward_runner, progress=progress, agent=agent)
        out.update({
            "eval/accuracy": float(correct(g, correctness).mean()),
            "eval/reward_mean": float(g.rewards.mean()),
            "eval/completion_length": float(g.completion_lengths().mean()),
        })
        if g.trajectories:
            out["eval/turns_mean"] = float(np.mean([t["turns"] for t in g.trajectories]))
            out["eval/tool_calls_mean"] = float(np.mean([t["num_tool_calls"] for t in g.trajectories]))
    sampled = None
    ks = _ks(k)
    if ks:
        n = max(n_samples, *ks)
        sampled = generate_rollouts(
            policy, prompts,
            SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, n=n, seed=seed),
            reward_runner, progress=progress, agent=agent)
        ok = correct(sampled, correctness).reshape(len(prompts), n)
        answers = [answer_key(t, correctness) for t in sampled.texts]
        c = ok.sum(axis=1)
        out["eval/pass@1_sampled"] = float(np.mean([pass_at_k(n, int(ci), 1) for ci in c]))
        out["eval/reward_mean_sampled"] = float(sampled.rewards.mean())
        for kk in ks:
            if kk == 1:
                continue
            out[f"eval/pass@{kk}"] = float(np.mean([pass_at_k(n, int(ci), kk) for ci in c]))
            out[f"eval/maj@{kk}"] = float(np.mean([maj_at_k(answers[i * n:(i + 1) * n], ok[i] > 0, kk)
                                                   for i in range(len(prompts))]))
    out["_greedy"] = g
    out["_sampled"] = sampled
    return out


def per_problem(e: dict[str, Any], records: Sequence[dict[str, Any]], *, correctness: str | None,
                k: int | Sequence[int] = 0, answer_field: str = "answer") -> list[dict[str, Any]]:
    """One row per problem of an `evaluate` result: prompt, gold answer, the greedy completion, the samples
    (text, answer key, correct, reward, finish reason) and the problem's own pass@k / maj@k."""
    g, s = e.get("_greedy"), e.get("_sampled")
    rows = []
    n = s.group_size if s is not None else 0
    g_ok = correct(g, correctness) if g is not None else None
    s_ok = correct(s, correctness) if s is not None else None
    for i, rec in enumerate(records):
        row: dict[str, Any] = {"index": i, "prompt": rec.get("prompt")}  # None: an environment's reset made it
        if answer_field in rec:
            row["answer"] = rec[answer_field]
        if g is not None:
            row["greedy"] = {"text": g.texts[i], "answer": answer_key(g.texts[i], correctness),
                             "correct": bool(g_ok[i]), "reward": float(g.rewards[i]),
                             "finish_reason": g.finish_reasons[i]}
            if g.trajectories:  # multi-turn: the conversation, tool calls and results
                row["greedy"]["trajectory"] = g.trajectories[i]
        if s is not None:
            texts = s.texts[i * n:(i + 1) * n]
            answers = [answer_key(t, correctness) for t in texts]
            ok = s_ok[i * n:(i + 1) * n] > 0
            row["samples"] = [{"text": t, "answer": a, "correct": bool(o), "reward": float(r), "finish_reason": f}
                              for t, a, o, r, f in zip(texts, answers, ok, s.rewards[i * n:(i + 1) * n],
                                                       s.finish_reasons[i * n:(i + 1) * n])]
            row["num_correct"] = int(ok.sum())
            for kk in _ks(k):
                row[f"pass@{kk}"] = pass_at_k(n, int(ok.sum()), kk)
                if kk > 1:
                    row[f"maj@{kk}"] = maj_at_k(answers, ok, kk)
        rows.append(row)
    return rows
