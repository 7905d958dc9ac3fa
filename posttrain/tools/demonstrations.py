"""Synthetic tool-use SFT conversations for arithmetic problems (reasoning-gym `chain_sum`, products...), in the
OpenAI-style format `posttrain sft` reads (`messages` with assistant `tool_calls` and `tool` results, `tools`).

A demonstration either calls the calculator with the problem's expression and copies its result:

    system: <system prompt>         user: State the final answer to ...: 361 - 220 - 607 =
    assistant: tool_calls [calculator(expression="361 - 220 - 607")]
    tool: -466                      assistant: <answer>-466</answer>

or answers in one go (`<answer>-466</answer>`), as real SFT data mixes worked and unworked answers. The share
of calls (`tool_fraction`) sets what a small model does after SFT: below one half, greedy decoding mostly
answers in one go (wrong on problems beyond its arithmetic) while sampling still calls the tool now and then,
which leaves multi-turn RL a lesson to learn: calling the tool pays.
"""

from __future__ import annotations

import random
import re
from typing import Sequence

from posttrain.tools.calculator import calculator
from posttrain.tools.loading import tool_from_callable

__all__ = ["arithmetic_expression", "calculator_conversation", "mixed_conversations"]

_TAIL = re.compile(r"([-+*/().\d\s]*\d[-+*/().\d\s]*)=\s*$")


def arithmetic_expression(prompt: str) -> str | None:
    """The expression before a prompt's final `=` (`"...problem: 361 - 220 - 607 ="` -> `"361 - 220 - 607"`)."""
    m = _TAIL.search(prompt)
    return m.group(1).strip() if m else None


def calculator_conversation(record: dict, *, use_tool: bool, system_prompt: str | None = None,
                            answer_format: str = "<answer>{}</answer>") -> dict:
    """One SFT record (`messages`, `tools`) for a problem `{"prompt", "answer"}`; with `use_tool`, a calculator
    call on the prompt's expression (its result must be the answer: a ValueError otherwise)."""
    answer = str(record["answer"])
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    messages.append({"role": "user", "content": record["prompt"]})
    if use_tool:
        expr = arithmetic_expression(record["prompt"])
        result = calculator(expr) if expr else None
        if result != answer:
            raise ValueError(f"calculator({expr!r}) = {result!r}, not the answer {answer!r} of {record['prompt']!r}")
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "calculator", "content": result}]
    messages.append({"role": "assistant", "content": answer_format.format(answer)})
    return {"messages": messages, "tools": [tool_from_callable(calculator).schema]}


def mixed_conversations(records: Sequence[dict], tool_fraction: float, seed: int = 0, **kwargs) -> list[dict]:
    """A conversation per record, each calling the calculator with probability `tool_fraction`."""
    rng = random.Random(seed)
    return [calculator_conversation(r, use_tool=rng.random() < tool_fraction, **kwargs) for r in records]
