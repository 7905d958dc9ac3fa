"""Multi-turn building blocks: tool-call parsers per chat format, the token buffer, the chat-template appender
under the real templates in tests/data/chat_templates (token-in/token-out: the model's tokens are kept exactly,
only appended tokens are tokenized, and the whole buffer reads as the template's own rendering), and
environments (loading, the examples' reset/tools/reward/step)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from test_chat_templates import FAMILIES, family_tokenizer

from posttrain.agent import (ChatTemplateAppender, TemplateError, TokenBuffer, load_environment, parse_error_messages,
                             parse_tool_calls, trajectory_reward)
from posttrain.agent.environments import EnvCallError
from posttrain.loading import LoadError
from posttrain.tools import ToolCall, ToolPool, load_tools, run_tool_call

CALL = {"name": "calculator", "arguments": {"expression": "12*34"}}


# ---------------------------------------------------------------------- parsers
def test_hermes_calls():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    got = parse_tool_calls(text)
    assert got.calls == [ToolCall("calculator", {"expression": "12*34"}), ToolCall("python", {"code": "print(1)"})]
    assert got.errors == []
    # generation stopped at the closing tag (a stop string): the open call is read to the end
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}\n').calls == [ToolCall("f", {})]
    assert not parse_tool_calls("The answer is 408.")


@pytest.mark.parametrize("text, why", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>', "invalid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>["f"]</tool_call>', "expected a JSON object"),
    ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "not JSON"),
])
def test_hermes_malformed_calls_are_parse_errors(text, why):
    got = parse_tool_calls(text + '<tool_call>{"name": "ok", "arguments": {}}</tool_call>')
    assert got.calls == [ToolCall("ok", {})]
    assert len(got.errors) == 1 and why in got.errors[0] and "\n" not in got.errors[0]
    [(msg, rec)] = parse_error_messages(got)  # what the model is told, and what metrics count
    assert msg["role"] == "tool" and why in json.loads(msg["content"])["error"] and rec.error == "parse"


def test_llama3_calls():
    assert parse_tool_calls(json.dumps({"name": "calculator", "parameters": {"expression": "12*34"}}),
                            "llama3").calls == [ToolCall("calculator", {"expression": "12*34"})]
    tagged = '<|python_tag|>{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": {}}<|eom_id|>'
    assert parse_tool_calls(tagged, "llama3").calls == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    assert not parse_tool_calls("The answer is {not a call}.", "llama3")
    bad = parse_tool_calls('<|python_tag|>{"name": "a", "parameters": {"x": }', "llama3")
    assert bad.calls == [] and "invalid JSON" in bad.errors[0]
    assert "no \"name\"" in parse_tool_calls('{"parameters": {}}', "llama3").errors[0]


def test_mistral_calls():
    text = '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "12*34"}, "id": "abc123xyz"}]</s>'
    assert parse_tool_calls(text, "mistral").calls == [ToolCall("calculator", {"expression": "12*34"}, "abc123xyz")]
    assert parse_tool_calls('[TOOL_CALLS]{"name": "f", "arguments": {}}', "mistral").calls == [ToolCall("f", {})]
    assert not parse_tool_calls("no calls here", "mistral")
    bad = parse_tool_calls('[TOOL_CALLS] [{"name": "f", "arguments": {]', "mistral")
    assert bad.calls == [] and "invalid JSON" in bad.errors[0]
    mixed = parse_tool_calls('[TOOL_CALLS] [{"name": "f", "arguments": 3}, {"name": "g", "arguments": {}}]', "mistral")
    assert mixed.calls == [ToolCall("g", {})] and "must be a JSON object" in mixed.errors[0]
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse_tool_calls("", "nope")


# ---------------------------------------------------------------------- buffer
def test_token_buffer():
    buf = TokenBuffer()
    buf.add_prompt([1, 2, 3])
    buf.add_sampled([4, 5], [-0.5, -0.25])
    buf.add_appended([6])
    buf.add_sampled([7], [-1.0])
    a = buf.arrays()
    assert a["token_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7] and a["loss_mask"].tolist() == [0, 0, 0, 1, 1, 0, 1]
    assert a["turns"].tolist() == [0, 0, 0, 0, 0, 1, 1] and buf.last_turn_ids() == [7]
    assert np.isnan(a["logprobs"][[0, 1, 2, 5]]).all() and a["logprobs"][[3, 4, 6]].tolist() == [-0.5, -0.25, -1.0]
    with pytest.raises(ValueError):
        buf.add_sampled([8, 9], [-1.0])
    with pytest.raises(ValueError):
        buf.add_prompt([1])


# ---------------------------------------------------------------------- templates: token-in/token-out
# The model's tool call per family's format, and what the appender adds after it (the tool result 408 and
# the template's glue: the rest of the turn's end, the result's turn, the next assistant header).
CALL_TEXT = {
    "hermes": "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>",
    "llama3": json.dumps({"name": "calculator", "parameters": {"expression": "12*34"}}),
    "mistral": "[TOOL_CALLS][" + json.dumps(CALL) + "]",
}
FORMAT = {"qwen2.5": "hermes", "qwen3": "hermes", "gemma": "hermes", "llama3": "llama3", "mistral": "mistral"}
APPENDED = {
    "qwen2.5": "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>tool<|end_header_id|>\n\n408<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "\n<start_of_turn>user\n<tool_response>\n408\n</tool_response><end_of_turn>\n<start_of_turn>model\n",
    "mistral": "[INST] <tool_response>\n408\n</tool_response> [/INST]",
}


def stop_ids(tok, family):
    """The ids the model ends its turn with (Gemma's instruction models stop at <end_of_turn>)."""
    texts = [FAMILIES[family][1]] + (["<end_of_turn>"] if family == "gemma" else [])
    return [tok.encode(t, add_special_tokens=False)[0] for t in texts]


@pytest.fixture(scope="module")
def pool():
    p = ToolPool(num_workers=2)
    yield p
    p.close()


def simulate(tok, appender, family, tools, pool):
    """A 3-turn conversation: a tool call, an answer, a user follow-up and a last answer. The 'sampled' ids
    come from tokenizing the assistant text directly (standing in for the sampler), stop token included."""
    stop_text = tok.decode([stop_ids(tok, family)[-1]], skip_special_tokens=False)
    first = ([{"role": "system", "content": "Be brief."}] if FAMILIES[family][3] else []) + [
        {"role": "user", "content": "What is 12*34?"}]
    buf, sampled, appended, rng = TokenBuffer(), [], [], np.random.default_rng(0)
    buf.add_prompt(appender.prompt_ids(first))
    transcript = appender.prompt_messages(first)
    for k, text in enumerate([CALL_TEXT[FORMAT[family]], "It is 408.", "410"]):
        ids = tok.encode(text + stop_text, add_special_tokens=False)
        sampled.append((ids, (-rng.random(len(ids))).tolist()))
        buf.add_sampled(*sampled[-1])
        transcript.append({"role": "assistant", "content": text})
        if k == 0:
            calls = parse_tool_calls(text, FORMAT[family])
            new = [run_tool_call(tools, c, timeout=30, max_output_chars=1000, pool=pool)[0] for c in calls.calls]
        elif k == 1:
            new = [{"role": "user", "content": "Now add 2."}]
        else:
            break
        appended.append(appender.append_ids(new, ids[-1]))
        buf.add_appended(appended[-1])
        transcript += appender.convert(new)
    return buf, sampled, appended, transcript


@pytest.mark.parametrize("family", list(FAMILIES))
def test_multi_turn_token_in_token_out(family, tmp_path, pool):
    tok = family_tokenizer(family, tmp_path)
    tools = load_tools(["calculator"])
    ap = ChatTemplateAppender(tok, list(tools.values()), stop_ids=stop_ids(tok, family), name=family)
    buf, sampled, appended, transcript = simulate(tok, ap, family, tools, pool)
    # the model's tokens are exactly the sampled ids and log-probs, with loss mask 1 exactly there
    a = buf.arrays()
    assert buf.sampled_ids == [i for ids, _ in sampled for i in ids]
    assert np.allclose(a["logprobs"][a["loss_mask"] == 1], [p for _, lps in sampled for p in lps])
    assert np.isnan(a["logprobs"][a["loss_mask"] == 0]).all()
    n_prompt = len(buf) - sum(len(s[0]) for s in sampled) - sum(map(len, appended))
    pieces = [(n_prompt, 0)] + [x for (ids, _), app in zip(sampled, appended + [[]]) for x in
                                ((len(ids), 1), (len(app), 0))]
    assert a["loss_mask"].tolist() == [m for n, m in pieces for _ in range(n)]
    for turn, (ids, _) in enumerate(sampled):
        assert a["token_ids"][(a["loss_mask"] == 1) & (a["turns"] == turn)].tolist() == ids
    # the appended ids decode to the tool result (and the template's glue), the user turn likewise
    assert tok.decode(appended[0], skip_special_tokens=False) == APPENDED[family]
    assert "Now add 2." in tok.decode(appended[1], skip_special_tokens=False)
    # the whole buffer reads as the template's rendering of the conversation (up to the model's stop token;
    # Qwen3 renders an empty <think> block before the last answer that the model did not write)
    full = tok.apply_chat_template(transcript, tokenize=False)
    decoded = tok.decode(buf.ids, skip_special_tokens=False)
    rest = ap.end_of_turn[len(tok.decode([sampled[-1][0][-1]], skip_special_tokens=False)):]
    expected = full[:len(full) - len(rest)] if rest else full
    if family == "qwen3":
        expected = expected.replace("<think>\n\n</think>\n\n", "")
    assert decoded == expected
    assert "# Tools" in decoded and '"name": "calculator"' in decoded  # the tools section (no tool support here)


# A ChatML template with tool support in the style of Qwen2.5's: tools listed in the system turn, tool results
# as user turns wrapped in <tool_response>. And a generic ChatML one (SmolLM2-style) that renders any role.
CHATML_TOOLS = (
    "{% if tools %}{{ '<|im_start|>system\\n' + (messages[0].content if messages[0].role == 'system' else 'Hi.') "
    "+ '\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}"
    "{% elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{% endif %}{% for m in messages %}{% if m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% elif m.role != 'system' %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML_ANY_ROLE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Ends the last assistant turn with <|im_end|> but earlier ones with <|sep|>: not prefix-preserving.
NOT_PREFIX_PRESERVING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if loop.last %}"
                         "<|im_end|>{% else %}<|sep|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Drops tool messages silently.
DROPS_TOOLS = ("{% for m in messages %}{% if m.role != 'tool' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
               "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_tokenizer(tmp_path, template):
    tok = family_tokenizer("qwen2.5", tmp_path)
    tok.hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|sep|>"]})
    tok.hf.chat_template = template
    return tok, stop_ids(tok, "qwen2.5")


def test_template_with_tool_support(tmp_path, pool):
    tok, stops = chatml_tokenizer(tmp_path, CHATML_TOOLS)
    tools = load_tools(["calculator"])
    ap = ChatTemplateAppender(tok, list(tools.values()), stop_ids=stops, name="chatml-tools")
    assert ap.renders_tools and ap.tool_role == "tool" and ap.supports_system
    prompt = tok.decode(ap.prompt_ids([{"role": "user", "content": "12*34?"}]), skip_special_tokens=False)
    assert "<tools>\n{\"type\": \"function\"" in prompt and "# Tools" not in prompt
    msg = run_tool_call(tools, parse_tool_calls(CALL_TEXT["hermes"]).calls[0], timeout=30, max_output_chars=100,
                        pool=pool)[0]
    ids = ap.append_ids([msg], stops[0])
    assert tok.decode(ids, skip_special_tokens=False) == APPENDED["qwen2.5"]
    # stopped at a stop string (</tool_call>) rather than the stop token: the whole end of turn is appended
    assert ap.append_text([msg], tok.encode(">", add_special_tokens=False)[0]) == "<|im_end|>" + APPENDED["qwen2.5"]


def test_generic_chatml_renders_the_tool_role(tmp_path):
    tok, stops = chatml_tokenizer(tmp_path, CHATML_ANY_ROLE)
    ap = ChatTemplateAppender(tok, load_tools(["calculator"]).values(), stop_ids=stops, name="smollm2-style")
    assert ap.tool_role == "tool" and not ap.renders_tools
    assert ap.append_text([{"role": "tool", "name": "calculator", "content": "408"}], stops[0]) == \
        "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    user = ChatTemplateAppender(tok, stop_ids=stops, tool_role="user")
    assert "<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n7\n</tool_response>\n\nGo on." \
        in user.append_text([{"role": "tool", "name": "a", "content": "408"}, {"role": "tool", "name": "b", "content": "7"},
                             {"role": "user", "content": "Go on."}], stops[0])


def test_non_prefix_preserving_template_is_refused(tmp_path):
    tok, stops = chatml_tokenizer(tmp_path, NOT_PREFIX_PRESERVING)
    with pytest.raises(TemplateError) as e:
        ChatTemplateAppender(tok, stop_ids=stops, name="broken.jinja")
    msg = str(e.value)
    assert "\n" not in msg and "broken.jinja" in msg and "not prefix-preserving" in msg
    assert "'<|im_end|>'" in msg and "'<|sep|>\\n" in msg and "first difference at character 2: 'im_end|>' vs 'sep|>" in msg
    tok.hf.chat_template = NOT_PREFIX_PRESERVING.replace("loop.last", "loop.last or messages[loop.index0 + 1].role "
                                                        "!= 'system'")  # passes the check, breaks after a system turn
    ap = ChatTemplateAppender(tok, stop_ids=stops, name="sneaky")
    with pytest.raises(TemplateError, match="sneaky ends the assistant turn with '<\\|sep\\|>"):
        ap.append_ids([{"role": "system", "content": "Time is up."}], stops[0])
    tok.hf.chat_template = DROPS_TOOLS
    assert ChatTemplateAppender(tok, stop_ids=stops).tool_role == "user"  # auto: falls back to user turns
    with pytest.raises(TemplateError, match="drops a tool message"):
        ChatTemplateAppender(tok, stop_ids=stops, name="drops", tool_role="tool")


def test_appender_notes_the_known_fixes(tmp_path):
    tok = family_tokenizer("qwen3", tmp_path)
    ap = ChatTemplateAppender(tok, stop_ids=stop_ids(tok, "qwen3"), name="qwen3")
    assert any("re-renders earlier turns" in f for f in ap.fixes) and any("'\\n'" in f for f in ap.fixes)
    tok = family_tokenizer("llama3", tmp_path / "l")
    assert ChatTemplateAppender(tok, stop_ids=stop_ids(tok, "llama3")).fixes == []


# ---------------------------------------------------------------------- environments
BAD_ENVS = '''
class NoReset:
    def step(self, text: str):
        return None, 0.0, True

class Untyped:
    def reset(self, record):
        return "hi"

    def look(self, where):
        """Look.

        Args:
            where: where
        """

class NeedsArgs:
    def __init__(self, size):
        self.size = size

    def reset(self, record):
        return "hi"

def not_a_class(record):
    return "hi"

class Broken:
    def reset(self, record):
        return 42

    def step(self, text: str):
        raise RuntimeError("game over, badly")

    def reward(self, completion: str) -> float:
        return float("nan")
'''


def test_environment_load_errors(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(BAD_ENVS)
    cases = {"NoReset": "environment class NoReset in file", "Untyped": "method Untyped.look in file",
             "NeedsArgs": "no arguments (its __init__ requires ['size'])", "not_a_class": "must be a class",
             "Missing": "not found"}
    for name, why in cases.items():
        with pytest.raises(LoadError) as e:
            load_environment(f"{path}:{name}")
        msg = str(e.value)
        assert msg.startswith("rollout.environment: ") and why in msg and "\n" not in msg, msg
        if name in ("NoReset", "Untyped"):
            assert str(path) in msg
    with pytest.raises(LoadError, match="^rollout.environment: environment file 'nonexist.py' not found"):
        load_environment("nonexist.py:Env")
    session = load_environment(f"{path}:Broken").make()
    with pytest.raises(EnvCallError, match="Broken.reset must return"):  # one line naming the class
        session.reset({})
    assert session.failure.kind == "bad_type" and session.failure.method == "reset"
    step = session.step("hello")
    assert step.done and step.error.startswith("Broken.step failed: RuntimeError: game over")
    reward, err = session.final_reward([{"role": "assistant", "content": "x"}])
    assert reward is None and "not finite" in err


def test_gsm8k_python_env():
    spec = load_environment("posttrain.agent.envs.gsm8k_python:GSM8KPython")
    assert spec.tool_names == ("python",) and spec.has_reward and not spec.has_step
    session = spec.make()
    record = {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                          "May. How many clips did Natalia sell altogether in April and May?",
              "answer": "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72"}
    messages = session.reset(record)
    assert messages[0]["role"] == "system" and messages[1] == {"role": "user", "content": record["question"]}
    msg, rec = run_tool_call(session.tools, ToolCall("python", {"code": "print(48 + 48 // 2)"}), timeout=30,
                             max_output_chars=1000)
    assert msg["content"] == "72" and rec.error is None
    msg, rec = run_tool_call(session.tools, ToolCall("python", {"code": "print(open('/etc/passwd').read())"}),
                             timeout=30, max_output_chars=1000)
    assert msg["content"].startswith("Error:") and "root:" not in msg["content"]  # not in the sandbox's view
    done = messages + [{"role": "assistant", "content": "So the total is \\boxed{72}."}]
    assert session.final_reward(done) == (1.0, None)
    assert session.final_reward(messages + [{"role": "assistant", "content": "\\boxed{71}"}]) == (0.0, None)
    assert spec.schemas[0]["function"]["parameters"]["required"] == ["code"]


@pytest.mark.slow
def test_chain_sum_env_with_the_calculator():
    from posttrain.data.reasoning_gym import records

    spec = load_environment("posttrain.agent.envs.chain_sum:ChainSum")
    assert spec.tool_names == ("calculator",)
    for record in records("reasoning_gym:chain_sum?size=4&seed=3"):
        session = spec.make()
        messages = session.reset(record)
        expression = re.search(r"([-\d][\d\s+\-*/()]*\d)\s*=?\s*$", messages[-1]["content"].strip()).group(1)
        msg, rec = run_tool_call(session.tools, ToolCall("calculator", {"expression": expression}), timeout=10,
                                 max_output_chars=100)
        assert rec.error is None and msg["content"] == str(record["answer"])
        assert session.final_reward(messages + [{"role": "assistant", "content": f"<answer>{msg['content']}</answer>"}]
                                    ) == (1.0, None)
        wrong = int(msg["content"]) + 1
        assert session.final_reward(messages + [{"role": "assistant", "content": f"<answer>{wrong}</answer>"}]
                                    ) == (0.0, None)
    session = spec.make()
    session.reset({"prompt": "What is 3 + 4?", "answer": "7"})
    assert session.final_reward([{"role": "assistant", "content": "<answer>7</answer>"}]) == (1.0, None)
    msg, rec = run_tool_call(session.tools, ToolCall("calculator", {"expression": "open('x')"}), timeout=10,
                             max_output_chars=100)
    assert msg["content"].startswith("Error:") and rec.error is None


def test_guess_number_step_env_and_summed_rewards():
    spec = load_environment("posttrain.agent.envs.guess_number:GuessNumber")
    assert spec.has_step and not spec.has_reward and spec.tool_names == ()
    session = spec.make()
    assert "1 to 100" in session.reset({"secret": 37})[0]["content"]
    lo, hi, steps = 1, 100, []
    while True:
        guess = (lo + hi) // 2
        steps.append(session.step(f"My guess is {guess}."))
        if steps[-1].done:
            break
        lo, hi = (guess + 1, hi) if steps[-1].observation == "higher" else (lo, guess - 1)
    assert steps[-1].reward == 1.0 and steps[-1].observation is None and len(steps) <= 7
    assert session.turn_rewards == [0.0] * (len(steps) - 1) + [1.0]
    assert trajectory_reward(session.turn_rewards, session.final_reward([])[0]) == 1.0
    assert trajectory_reward([0.5, 0.25], 1.0) == 1.75 and math.isclose(trajectory_reward([], None), 0.0)
    lost = spec.make()
    lost.reset({"secret": 5, "max_guesses": 2})
    assert lost.step("no idea").observation == "Please answer with a number."
    last = lost.step("50")
    assert last.done and last.reward == 0.0 and last.observation == "lower"
