"""The server's text pieces: incremental detokenization with stop strings (`TextStream`), the held-back content of a
streamed reply that may start a tool call, log-probs in OpenAI's two layouts (the chosen token always among the
top ones, with its own number; sorted), and conversations rendered in the model's prompt format."""

from __future__ import annotations

import pytest

from posttrain.models.prompt_format import PromptStyle
from posttrain.models.tokenizer import build_tokenizer
from posttrain.rollout.policy import Policy
from posttrain.serve.chat import _Held
from posttrain.serve.errors import APIError
from posttrain.serve.models import ServedModel
from posttrain.serve.text import TextStream, TokenLogprob, chat_logprobs, completion_logprobs


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def stream(tok, text, stops, pieces=1):
    ids = tok.encode(text, add_special_tokens=False)
    ts = TextStream(tok, stops)
    out = [ts.add(t) for t in ids] + [ts.finish()]
    return out, ts


@pytest.mark.parametrize("stops, want", [([], "abc def ghi"), (["def"], "abc "), (["c d", "zz"], "ab"),
                                         (["ghi"], "abc def "), (["xyz"], "abc def ghi"), (["i"], "abc def gh")])
def test_stop_strings_cut_the_text_and_pieces_never_hold_a_stop(tok, stops, want):
    out, ts = stream(tok, "abc def ghi", stops)
    assert "".join(out) == want and ts.stopped == any(s in "abc def ghi" for s in stops)
    for k in range(len(out)):  # what was released at any point never contains the start of a stop that came
        assert not any(s in "".join(out[: k + 1]) for s in stops)


def test_a_tail_that_may_start_a_stop_is_held_then_released(tok):
    ids = tok.encode("abcab", add_special_tokens=False)
    ts = TextStream(tok, ["abd"])
    assert [ts.add(t) for t in ids] == ["", "", "abc", "", ""]  # "a" and "ab" may begin "abd"
    assert ts.finish() == "ab" and not ts.stopped


def test_special_tokens_make_no_text(tok):
    ts = TextStream(tok, [])
    assert ts.add(tok.eos_token_id) == "" and ts.add(tok.encode("x", add_special_tokens=False)[0]) == "x"


def test_held_tool_call_content():
    h = _Held("hermes")
    assert h.add("Let me ") == "Let me " and h.add("add <tool") == "add " and h.add("_call>{") == ""
    assert h.holding and h.rest() == "<tool_call>{"
    h = _Held("hermes")
    assert h.add("a <to") == "a " and h.add("p") == "<top"  # not a marker after all
    h = _Held("llama3")
    assert h.add("  ") == "" and h.add('{"name"') == "" and h.holding


def test_log_probs_layouts(tok):
    a, b, c = (tok.encode(x, add_special_tokens=False)[0] for x in "abc")
    pos = [TokenLogprob(a, None, None), TokenLogprob(b, -0.5, [(b, -0.5000001), (c, -1.0)]),
           TokenLogprob(c, -3.0, [(a, -0.2), (b, -0.9)])]
    out = completion_logprobs(tok, pos, 2)
    assert out["tokens"] == ["a", "b", "c"] and out["token_logprobs"] == [None, -0.5, -3.0]
    assert out["top_logprobs"][0] is None and out["text_offset"] == [0, 1, 2]
    assert out["top_logprobs"][1] == {"b": -0.5, "c": -1.0}  # the chosen one's own number
    assert list(out["top_logprobs"][2]) == ["a", "b", "c"]  # k + 1 entries: the chosen token added, sorted
    chat = chat_logprobs(tok, pos[1:], 2, as_ids=True)["content"]
    assert chat[0]["token"] == f"token_id:{b}" and chat[0]["top_logprobs"][0]["logprob"] == -0.5
    assert [t["logprob"] for t in chat[1]["top_logprobs"]] == [-0.2, -0.9]


def test_conversations_follow_the_models_prompt_format(tok):
    convo = [{"role": "system", "content": "s"}, {"role": "user", "content": "first"},
             {"role": "assistant", "content": "x"}, {"role": "user", "content": "2+2="}]
    raw = ServedModel(Policy(None, tok, style=PromptStyle(chat=False), sampler=object()))
    assert raw.render_chat(convo) == (tok.encode("2+2="), [])  # a raw-trained model: the last user turn's text
    with pytest.raises(APIError, match="needs a user message"):
        raw.render_chat([{"role": "system", "content": "s"}])
    chat = ServedModel(Policy(None, tok, style=PromptStyle(chat=True, system_prompt="Be brief."), sampler=object()))
    ids, _ = chat.render_chat(convo[1:])
    assert ids == tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *convo[1:]],
                                          add_generation_prompt=True)
    assert chat.render_chat(convo)[0] == tok.apply_chat_template(convo, add_generation_prompt=True)
