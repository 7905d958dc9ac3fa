"""reasoning-gym `chain_sum` (sums and differences of several numbers) with the calculator tool.

Records are those of the `reasoning_gym:chain_sum?size=N&seed=S` data source (`prompt`, `answer`,
`rg_source`, `rg_index`); the answer goes in `<answer>...</answer>` and is scored by the task's own checker
(the `reasoning_gym` reward), or by exact number match for records without `rg_source`.
"""

from __future__ import annotations

from posttrain.rewards.math_answer import answers_match
from posttrain.rewards.reasoning_gym import extract, reasoning_gym_reward
from posttrain.tools.calculator import calculator as _calculate

SYSTEM = ("Compute the result. You can use the calculator tool for arithmetic. "
          "Put the final number inside <answer></answer>.")


class ChainSum:
    """One chain_sum problem; counts the calculator calls it served."""

    def reset(self, record: dict) -> list[dict]:
        self.record = dict(record)
        self.calls = 0
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": record["prompt"]}]

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return the result.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. "12 + 7 - 3"
        """
        self.calls += 1
        return _calculate(expression)

    def reward(self, completion: str) -> float:
        rec = self.record
        if "rg_source" in rec:
            return reasoning_gym_reward([rec["prompt"]], [completion], [rec["rg_source"]], [rec["rg_index"]])[0]
        answer = extract(completion)
        return float(answer is not None and answers_match(answer, str(rec["answer"])))
