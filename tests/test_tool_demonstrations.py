"""Synthetic calculator conversations (`posttrain.tools.demonstrations`): the expression read from the prompt,
a call whose result is the answer, the mix of calls and direct answers, and what SFT's loss sees of them."""

from __future__ import annotations

import pytest

from posttrain.data import encode_record
from posttrain.tools.demonstrations import arithmetic_expression, calculator_conversation, mixed_conversations
from test_chat_templates import family_tokenizer

PROBLEM = {"prompt": "State the final answer to the following arithmetic problem: 361 - 220 - 607 =", "answer": "-466"}
SYSTEM = "Solve the problem. Put only the final answer between <answer> and </answer>."


def test_arithmetic_expression():
    assert arithmetic_expression(PROBLEM["prompt"]) == "361 - 220 - 607"
    assert arithmetic_expression("423*456=") == "423*456"
    assert arithmetic_expression("What is the capital of France?") is None


def test_call_conversation():
    rec = calculator_conversation(PROBLEM, use_tool=True, system_prompt=SYSTEM)
    roles = [m["role"] for m in rec["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    call = rec["messages"][2]["tool_calls"][0]["function"]
    assert call == {"name": "calculator", "arguments": {"expression": "361 - 220 - 607"}}
    assert rec["messages"][3]["content"] == "-466"
    assert rec["messages"][-1]["content"] == "<answer>-466</answer>"
    assert [t["function"]["name"] for t in rec["tools"]] == ["calculator"]
    direct = calculator_conversation(PROBLEM, use_tool=False)
    assert [m["role"] for m in direct["messages"]] == ["user", "assistant"]
    with pytest.raises(ValueError, match="not the answer"):
        calculator_conversation({**PROBLEM, "answer": "7"}, use_tool=True)


def test_mix_is_seeded():
    problems = [PROBLEM] * 400
    calls = [sum(len(c["messages"]) > 2 for c in mixed_conversations(problems, 0.3, seed=s)) for s in (0, 0, 1)]
    assert calls[0] == calls[1] != calls[2]
    assert 90 <= calls[0] <= 150


def test_loss_sees_the_call_and_the_answer(tmp_path):
    """A template without tool support (ChatML): tools section in the system turn, the call as Hermes text;
    the loss is on the call and the answer only."""
    tok = family_tokenizer("qwen2.5", tmp_path)
    ex = encode_record(calculator_conversation(PROBLEM, use_tool=True, system_prompt=SYSTEM), tok)
    text = tok.decode(list(ex.input_ids), skip_special_tokens=False)
    assert text.index(SYSTEM) < text.index("# Tools") < text.index(PROBLEM["prompt"])
    seen = tok.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m], skip_special_tokens=False)
    assert seen == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "361 - 220 - 607"}}\n</tool_call>'
                    "<|im_end|>\n<answer>-466</answer><|im_end|>\n")
