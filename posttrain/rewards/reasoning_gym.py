"""`reasoning_gym` reward: a completion scored by its reasoning-gym task's own checker (`score_answer`).

The answer is the content of the last `<answer>...</answer>` tag (reasoning-gym's convention); without a
tag, `fallback="math"` (default) takes the final answer the way `math_answer` does (`\\boxed{}`, `####`,
"the answer is", else the last number) and `fallback="none"` gives no answer (score 0). Needs the record
fields `rg_source` and `rg_index` that `reasoning_gym:` data sources carry.
"""

from __future__ import annotations

from posttrain.data.reasoning_gym import dataset
from posttrain.rewards.math_answer import extract_answer as extract_math_answer


def extract(completion: str, fallback: str = "math") -> str | None:
    # lazy: reasoning_gym (~2 s) loads only for its reward, in the reward workers
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(completion, tag_name="answer")
    if answer is None and fallback == "math":
        answer = extract_math_answer(completion)
    return answer


def reasoning_gym_reward(prompts, completions, rg_source, rg_index, fallback: str = "math") -> list[float]:
    """Score in [0, 1] per completion from the task's `score_answer(answer, entry)`."""
    if fallback not in ("math", "none"):
        raise ValueError(f"reasoning_gym reward: fallback={fallback!r}; accepted: math, none")
    scores = []
    for completion, source, index in zip(completions, rg_source, rg_index):
        ds = dataset(source)
        scores.append(float(ds.score_answer(extract(completion, fallback), ds[int(index)])))
    return scores
