"""The demo's synthetic task: chained additions with a short worked solution and an exactly checkable answer.

A problem is `a+b+c=` with 1-2 digit numbers; its worked solution writes the two partial sums and the
final answer in the GSM8K style the `math_answer` reward reads: `a+b=s,s+c=t #### t`. The answer is
exact (integer), the text is short (a character tokenizer needs ~30 tokens) and the task has carries, so a
tiny model learns it in minutes on a CPU but not instantly.

Like much real SFT data, the demonstrations are mixed: a fraction `direct_fraction` of them state the
answer without working (`#### t`). A small model imitates both styles, and answering in one go is far
less accurate than working it out, so after a short SFT stage the model often takes the shortcut and
gets it wrong. RL with the exact-answer reward has a clear lesson to learn: showing the work pays.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def make_problem(rng: random.Random, max_operand: int = 99, terms: int = 3, direct: bool = False) -> dict:
    """One problem; `direct` writes the answer without the worked steps."""
    nums = [rng.randint(0, max_operand) for _ in range(terms)]
    prompt = "+".join(map(str, nums)) + "="
    steps, total = [], nums[0]
    for n in nums[1:]:
        steps.append(f"{total}+{n}={total + n}")
        total += n
    completion = f"#### {total}" if direct else ",".join(steps) + f" #### {total}"
    return {"prompt": prompt, "completion": completion, "answer": str(total)}


def make_splits(seed: int, n_train: int, n_eval: int, direct_fraction: float = 0.0,
                **kw) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out problem sets (held-out prompts never appear in train); a fraction
    `direct_fraction` of the train completions skip the working."""
    rng = random.Random(seed)
    eval_set: dict[str, dict] = {}
    while len(eval_set) < n_eval:
        p = make_problem(rng, **kw)
        eval_set.setdefault(p["prompt"], p)
    train: list[dict] = []
    while len(train) < n_train:
        p = make_problem(rng, direct=rng.random() < direct_fraction, **kw)
        if p["prompt"] not in eval_set:
            train.append(p)
    return train, list(eval_set.values())


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path
