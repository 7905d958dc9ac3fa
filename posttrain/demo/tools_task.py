"""The tool-use demo's task: products of two 3-digit numbers, which a tiny model cannot compute, and the
built-in `calculator` tool, which it can call.

A problem is `a*b=` (317 <= a, b <= 999, so that every product has 6 digits and a demonstration's layout is
fixed); the answer is written `#### p`, as the `math_answer` reward reads it.
A demonstration either calls the calculator and copies its result:

    <|user|>423*456=<eos><|assistant|><tool_call>{"name": "calculator", "arguments": {"expression": "423*456"}}
    </tool_call><eos><|user|><tool_response>192888</tool_response><eos><|assistant|>#### 192888<eos>

or answers in one go (`#### 192888`), as much real SFT data mixes worked and unworked answers. A tiny model
imitates both styles; answering in one go is almost always wrong (it cannot multiply 3-digit numbers), so
after SFT greedy decoding takes the shortcut (the majority of the demonstrations), and RL with the exact-answer reward has a clear lesson
to learn: calling the tool pays.

The demo's character tokenizer gets the four tag strings, and the fixed JSON around a calculator call's
expression (`CALL_PREFIX`, `CALL_SUFFIX`), as single tokens, and a chat template with tool support in the
format above (a one-line `tools:` system turn instead of whole JSON schemas). The text is unchanged (the
Hermes parser reads it as ever); only its tokenization is shorter: a call is 11 tokens instead of 64, and
the digits a model copies sit at fixed offsets from the problem's, which a tiny model from scratch learns
in a few hundred steps on a CPU.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from posttrain.models import tokenizer as tok_lib
from posttrain.models.tokenizer import build_tokenizer
from posttrain.tools import calculator, tool_from_callable

TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
#: The fixed JSON of a calculator call before and after its expression (as the template's `tojson` writes it).
CALL_PREFIX = '{"name": "calculator", "arguments": {"expression": "'
CALL_SUFFIX = '"}}'

#: `<|role|>content<eos>` per message; tools named in a system turn; calls as `<tool_call>{json}</tool_call>`
#: (the Hermes format the default parser reads); tool results as a user turn in `<tool_response>` tags.
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|system|>tools:' }}{% for t in tools %}{{ ' ' + (t.function.name if t.function is defined "
    "else t.name) }}{% endfor %}{{ eos_token }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}{{ '<|user|><tool_response>' + m.content + '</tool_response>' + eos_token }}"
    "{% elif m.role in ['system', 'user', 'assistant'] %}{{ '<|' + m.role + '|>' + (m.content or '') }}"
    "{% for c in (m.tool_calls or []) %}{{ '<tool_call>' + ({'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson) + '</tool_call>' }}{% endfor %}{{ eos_token }}"
    "{% else %}{{ raise_exception('unsupported role: ' + m.role) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tools_tokenizer(folder: Path):
    """The demo's character tokenizer with the tag and call tokens and the tool-use chat template, saved in
    `folder`."""
    tok = build_tokenizer(folder)
    tok.hf.add_tokens(TAGS + [CALL_PREFIX, CALL_SUFFIX])
    tok.hf.chat_template = TOOLS_TEMPLATE
    tok.hf.save_pretrained(str(folder))
    return tok_lib.load(folder)


def calculator_schema() -> dict:
    return tool_from_callable(calculator).schema


def make_problem(rng: random.Random, *, use_tool: bool, low: int = 317, high: int = 999) -> dict:
    """One problem: its prompt, answer and SFT conversation (with a calculator call when `use_tool`)."""
    a, b = rng.randint(low, high), rng.randint(low, high)
    expr, answer = f"{a}*{b}", str(a * b)
    messages = [{"role": "user", "content": expr + "="}]
    if use_tool:
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "calculator", "content": calculator(expr)}]
    messages.append({"role": "assistant", "content": f"#### {answer}"})
    return {"prompt": expr + "=", "answer": answer, "messages": messages}


def make_splits(seed: int, n_train: int, n_eval: int, tool_fraction: float) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out problems; a fraction `tool_fraction` of the train conversations call
    the calculator, the others answer in one go."""
    rng = random.Random(seed)
    heldout: dict[str, dict] = {}
    while len(heldout) < n_eval:
        p = make_problem(rng, use_tool=False)
        heldout.setdefault(p["prompt"], p)
    train: list[dict] = []
    while len(train) < n_train:
        p = make_problem(rng, use_tool=rng.random() < tool_fraction)
        if p["prompt"] not in heldout:
            train.append(p)
    return train, list(heldout.values())


def sft_records(problems: list[dict]) -> list[dict]:
    schema = [calculator_schema()]
    return [{"messages": p["messages"], "tools": schema} for p in problems]


def prompt_records(problems: list[dict]) -> list[dict]:
    return [{"prompt": p["prompt"], "answer": p["answer"]} for p in problems]


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
