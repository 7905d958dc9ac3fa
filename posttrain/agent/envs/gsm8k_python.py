"""GSM8K with a Python interpreter: the model may run code (sandboxed, see posttrain.tools.python_sandbox)
and ends with its answer in \\boxed{}; scored by `math_answer` against the record's `answer` field."""

from __future__ import annotations

from posttrain.rewards.math_answer import score_answer
from posttrain.tools.python_sandbox import run_python

SYSTEM = ("Solve the math problem. You can run Python code with the python tool to compute; print the values "
          "you need. Give the final answer as \\boxed{number}.")


class GSM8KPython:
    """One GSM8K problem (records with `question` and `answer`, as in the GSM8K JSONL splits)."""

    def reset(self, record: dict) -> list[dict]:
        self.answer = record["answer"]
        self.code_runs = 0
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": record["question"]}]

    def python(self, code: str) -> str:
        """Run a Python program in a sandbox and return what it prints.

        Args:
            code: a Python program; print the values you want to see
        """
        self.code_runs += 1
        return run_python(code)

    def reward(self, completion: str) -> float:
        return score_answer(completion, self.answer)
