"""Greedy accuracy of a real model (default: SmolLM2-135M-Instruct from the package registry) on reasoning-gym
tasks and on GSM8K, with its chat template, scored by each task's own checker (`reasoning_gym` reward) or by
`math_answer` (GSM8K).

    python benchmarks/eval_real_base.py --tasks "reasoning_gym:chain_sum?size=200&seed=1000" --gsm8k 200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]
SYSTEM = "Solve the problem. Put only the final answer between <answer> and </answer>."
GSM8K_SYSTEM = "Solve the problem step by step. End with: The answer is <number>."


def encode(tok, records, system):
    out = []
    for r in records:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": r["prompt"]}]
        out.append(tok.apply_chat_template(msgs, add_generation_prompt=True))
    return out


def evaluate_set(policy, records, reward, system, max_new_tokens):
    from posttrain.rewards import RewardRunner
    from posttrain.eval.evaluate import evaluate
    from posttrain.rollout.prompts import PromptSet

    ids = encode(policy.tokenizer, records, system)
    t = time.perf_counter()
    with RewardRunner([reward], num_workers=1) as runner:
        out = evaluate(policy, PromptSet.of(records, ids), runner, correctness=reward, max_new_tokens=max_new_tokens)
    greedy = out.pop("_greedy")
    out["seconds"] = round(time.perf_counter() - t, 1)
    out["examples"] = greedy.texts[:2]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pypi:smollm2-135m-instruct")
    p.add_argument("--tasks", nargs="*", default=["reasoning_gym:chain_sum?size=200&seed=1000"])
    p.add_argument("--gsm8k", type=int, default=0, help="GSM8K test problems (0 = skip)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--gsm8k-max-new-tokens", type=int, default=256)
    p.add_argument("--slots", type=int, default=32)
    args = p.parse_args(argv)

    from posttrain.data import read_prompts
    from posttrain.rollout.policy import Policy

    policy = Policy.open(args.model, mesh=None, max_slots=args.slots)
    results = {}
    for spec in args.tasks:
        res = evaluate_set(policy, read_prompts(spec), "reasoning_gym", SYSTEM, args.max_new_tokens)
        results[spec] = res
        print(json.dumps({spec: res}), flush=True)
    if args.gsm8k:
        recs = read_prompts(str(REPO / "../shared/data/gsm8k/test.jsonl"), prompt_field="question")[: args.gsm8k]
        res = evaluate_set(policy, recs, "math_answer", GSM8K_SYSTEM, args.gsm8k_max_new_tokens)
        results["gsm8k"] = res
        print(json.dumps({"gsm8k": res}), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
