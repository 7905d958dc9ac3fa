"""Tool-use SFT: OpenAI-style conversations (assistant `tool_calls`, `tool` messages, a `tools` column of JSON
schemas) rendered with the template's tool support, or rewritten for templates without it, with the loss on
assistant turns only; and what SFT renders is what a multi-turn rollout shows the model (same ids)."""

from __future__ import annotations

import json

import pytest

from posttrain.agent.templates import ChatTemplateAppender
from posttrain.data import DataError, encode_record
from posttrain.tools import calculator, tool_from_callable
from test_agent import stop_ids
from test_chat_templates import FAMILIES, TEMPLATES, family_tokenizer

SCHEMA = tool_from_callable(calculator).schema
CALL = {"type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": "123*456"})}}
CONVERSATION = [
    {"role": "user", "content": "What is 123*456?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "name": "calculator", "content": "56088"},
    {"role": "assistant", "content": "56088"},
]
HERMES = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>'
# What the loss sees: the call turn and the answer turn with their ends of turn; never the tools, the tool
# result, the user turn or the assistant headers.
EXPECTED = {
    "qwen2.5-tools": HERMES + "<|im_end|>\n56088<|im_end|>\n",
    "qwen3-tools": HERMES + "<|im_end|>\n<think>\n\n</think>\n\n56088<|im_end|>\n",
    "llama3.1-tools": '{"name": "calculator", "parameters": {"expression": "123*456"}}<|eot_id|>56088<|eot_id|>',
    "gemma": HERMES + "<end_of_turn>\n56088<end_of_turn>\n",
    "qwen2.5": HERMES + "<|im_end|>\n56088<|im_end|>\n",
}
BASE = {"qwen2.5-tools": "qwen2.5", "qwen3-tools": "qwen3", "llama3.1-tools": "llama3"}


def tokenizer_for(name, folder):
    tok = family_tokenizer(BASE.get(name, name), folder)
    tok.hf.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


@pytest.mark.parametrize("name", list(EXPECTED))
def test_tool_conversation_loss_on_assistant_turns_only(name, tmp_path):
    tok = tokenizer_for(name, tmp_path)
    messages = [dict(m) for m in CONVERSATION]
    if FAMILIES[BASE.get(name, name)][3]:
        messages.insert(0, {"role": "system", "content": "Be brief."})
    ex = encode_record({"messages": messages, "tools": json.dumps([SCHEMA])}, tok)
    text = tok.decode(ex.input_ids, skip_special_tokens=False)
    assert tok.decode(ex.input_ids[ex.loss_mask > 0], skip_special_tokens=False) == EXPECTED[name]
    assert "What is 123*456?" in text and "56088" in text
    assert '"calculator"' in text.split("What is")[0] + text  # the schema is rendered somewhere in the prompt
    assert text.count("calculator") >= 2  # schema and call
    runs = sum(1 for i in range(1, len(ex.loss_mask)) if ex.loss_mask[i] > 0 and ex.loss_mask[i - 1] == 0)
    assert runs == 2


@pytest.mark.parametrize("name", ["gemma", "qwen2.5", "qwen2.5-tools"])
def test_sft_rendering_equals_the_rollout_buffer(name, tmp_path):
    """prompt ids + the model's call + appended ids (tool result, next header) + the answer, as a multi-turn
    rollout builds them, are the ids SFT trains on (so SFT teaches exactly what RL shows)."""
    tok = tokenizer_for(name, tmp_path)
    stops = stop_ids(tok, BASE.get(name, name))
    app = ChatTemplateAppender(tok, [SCHEMA], stop_ids=stops)
    stop = stops[-1]
    ex = encode_record({"messages": CONVERSATION, "tools": [SCHEMA]}, tok)
    buffer = app.prompt_ids(CONVERSATION[:1]) + tok.encode(HERMES, add_special_tokens=False) + [stop]
    buffer += app.append_ids([CONVERSATION[2]], stop) + tok.encode("56088", add_special_tokens=False) + [stop]
    rendered = list(ex.input_ids)
    assert rendered[: len(buffer)] == buffer
    assert tok.decode(rendered[len(buffer):], skip_special_tokens=False).strip() == ""  # only the turn end's "\n"


def test_bad_tool_records_name_the_record(tmp_path):
    tok = tokenizer_for("qwen2.5-tools", tmp_path)
    bad_args = [dict(CONVERSATION[1], tool_calls=[{"function": {"name": "calculator", "arguments": "{oops"}}])]
    with pytest.raises(DataError, match=r"record 3: message 1: tool call 0 \(calculator\): arguments are not JSON"):
        encode_record({"messages": [CONVERSATION[0], *bad_args]}, tok, index=2)
    with pytest.raises(DataError, match="record 1: field 'tools' must be a list of JSON schemas"):
        encode_record({"messages": CONVERSATION, "tools": {"name": "x"}}, tok, index=0)
    with pytest.raises(DataError, match="message 1 must be an object with 'role' and 'content'"):
        encode_record({"messages": [CONVERSATION[0], {"role": "user"}]}, tok, index=0)
