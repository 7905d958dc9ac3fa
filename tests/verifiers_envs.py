"""verifiers environments for the tests (verifiers 0.1.9's classic classes), their datasets built here (no hub):
`load_environment(kind=...)` gives a `SingleTurnEnv`, a `ToolEnv` (one tool) or a two-turn `MultiTurnEnv`, each
scored by a rubric whose reward is 0.1 x the length of the last assistant reply (capped at 1) and which reports a
second metric (`has_vowel`, weight 0)."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def _rows(n: int) -> Dataset:
    return Dataset.from_list([{"question": f"Say {i} words.", "answer": str(i)} for i in range(n)])


def _last_reply(completion) -> str:
    replies = [m for m in completion if m.get("role") == "assistant"]
    return str(replies[-1].get("content") or "") if replies else ""


def length_reward(completion, **kwargs) -> float:
    """0.1 x the last assistant reply's length, at most 1."""
    return min(1.0, 0.1 * len(_last_reply(completion)))


def has_vowel(completion, **kwargs) -> float:
    return float(any(c in "aeiou" for c in _last_reply(completion)))


def lookup(word: str) -> str:
    """Looks a word up.

    Args:
        word: the word to look up.
    """
    return f"{word} means {word[::-1]}"


class TwoTurns(vf.MultiTurnEnv):
    """Every reply gets one more user turn; two assistant turns in all."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Again."}]


def load_environment(kind: str = "single", rows: int = 4, **kwargs) -> vf.Environment:
    rubric = vf.Rubric(funcs=[length_reward, has_vowel], weights=[1.0, 0.0])
    common = {"dataset": _rows(rows), "eval_dataset": _rows(3), "rubric": rubric}
    if kind == "single":
        return vf.SingleTurnEnv(system_prompt="Answer briefly.", **common)
    if kind == "tool":
        return vf.ToolEnv(tools=[lookup], max_turns=3, **common)
    if kind == "multi":
        return TwoTurns(max_turns=2, **common)
    if kind == "broken":
        raise RuntimeError("this environment cannot load")
    raise ValueError(f"unknown kind {kind!r}")
