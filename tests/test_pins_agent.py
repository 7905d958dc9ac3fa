"""Pins of the multi-turn agent's token-in/token-out contract (issues 41, 42): the tokens are recorded once (the
trajectory's buffer is read from the sampler's completion, and a completion of another length is refused); the trajectory budget (`max_total_tokens`) and the sampler's `room`
bound an append exactly; the chat-template appender's ids equal the in-context tokenization of the full rendering
under a SentencePiece-style tokenizer (Metaspace, prepend "first"), not the suffix tokenized alone. No model, no
tool processes: an in-process tool and the turns written as text."""

from __future__ import annotations

import string

import pytest

from posttrain.agent import ChatTemplateAppender
from posttrain.agent.rollout import Agent, AgentLimits, Trajectory
from posttrain.models.tiny import resolve_model_path
from posttrain.models.tokenizer import Tokenizer
from posttrain.models.tokenizer import load as load_tokenizer
from posttrain.tools.loading import tool_from_callable


def add(a: int, b: int) -> str:
    """Adds two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return str(a + b)


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path("tiny:llama"))


@pytest.fixture
def agent(tok):
    def make(**limits):
        a = Agent(tok, tools={"add": tool_from_callable(add)}, limits=AgentLimits(**limits))
        made.append(a)
        return a

    made: list[Agent] = []
    yield make
    for a in made:
        a.close()


def _turn(tok, text: str, scale: float = 0.1):
    """A model turn written as text: its ids (stop token last) and made-up log-probs."""
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return ids, [-scale * (k + 1) for k in range(len(ids))]


def _trajectory(agent):
    record = {"prompt": "What is 2 + 3?"}
    return Trajectory(agent, record, agent.prompt_ids(agent.first_messages(record)))


# ---------------------------------------------------------------------- 1. one record of the tokens
def test_the_buffer_is_read_from_the_samplers_record_and_a_wrong_length_is_refused(tok, agent):
    """The trajectory records no token: its buffer is the sampler's completion read back (prompt, sampled runs with
    their log-probs, appended runs with NaN and a new turn), exactly what recording each turn built; a completion
    of another length than the turns and appends it saw is refused."""
    import math

    from posttrain.agent import TokenBuffer
    from posttrain.sampling import Completion

    traj = _trajectory(agent())
    ids0, lps0 = _turn(tok, CALL)
    app = traj.on_turn(ids0, lps0, "stop", 10_000)
    assert isinstance(app, list) and app and traj.finish_reason is None and traj.buffer is None
    ids1, lps1 = _turn(tok, "It is 5.", 0.2)
    assert traj.on_turn(ids1, lps1, "stop", 10_000) is None and traj.finish_reason == "stop"
    assert traj.length == len(ids0) + len(app) + len(ids1)
    # the completion as the sampler hands it over: appended ids with log-prob 0.0 and mask 0
    mask = [1] * len(ids0) + [0] * len(app) + [1] * len(ids1)
    done = Completion(0, 0, ids0 + app + ids1, lps0 + [0.0] * len(app) + lps1, None, "stop", mask=mask, turns=2)
    traj.finish(done)
    want = TokenBuffer()
    want.add_prompt(traj.prompt_ids)
    want.add_sampled(ids0, lps0)
    want.add_appended(app)
    want.add_sampled(ids1, lps1)
    got = traj.buffer
    assert (got.ids, got.loss_mask, got.turns, got.turn) == (want.ids, want.loss_mask, want.turns, want.turn)
    assert [p for p, m in zip(got.logprobs, got.loss_mask) if m] == lps0 + lps1
    assert all(math.isnan(p) for p, m in zip(got.logprobs, got.loss_mask) if not m)
    assert got.last_turn_ids() == ids1
    for short in (done.token_ids[:-1], done.token_ids + [0]):
        n = len(short)
        with pytest.raises(RuntimeError, match="the sampler's completion has"):
            traj.finish(Completion(0, 0, short, [0.0] * n, None, "stop", mask=[1] * n, turns=2))


# ---------------------------------------------------------------------- 3. budgets: max_total_tokens and room
def _first_append(tok, agent, **limits):
    """A trajectory after its first turn (a tool call) given `room`: (its trajectory, the turn's ids, what
    `on_turn` returned)."""
    room = limits.pop("room", 10_000)
    traj = _trajectory(agent(**limits))
    ids, lps = _turn(tok, CALL)
    return traj, ids, traj.on_turn(ids, lps, "stop", room)


def test_an_append_that_exactly_fills_the_budget_fits_and_one_more_does_not(tok, agent):
    _, ids, app = _first_append(tok, agent)
    n = len(app)
    assert n > 1
    # max_total_tokens counts the tokens after the prompt, sampled and appended, and keeps one for the next turn:
    # an append fits when sampled + appended + 1 <= budget
    exact = len(ids) + n + 1
    traj, _, got = _first_append(tok, agent, max_total_tokens=exact)
    assert got == app and traj.finish_reason is None
    assert traj.length == exact - 1
    traj, _, got = _first_append(tok, agent, max_total_tokens=exact - 1)
    assert got is None and traj.finish_reason == "truncated"
    assert traj.length == len(ids)  # nothing appended
    assert traj.messages[-1]["role"] == "assistant"  # the messages keep what the model saw
    # the sampler's `room` (the most ids an append may hold): exactly `n` fits, n - 1 does not
    traj, _, got = _first_append(tok, agent, room=n)
    assert got == app and traj.finish_reason is None
    traj, _, got = _first_append(tok, agent, room=n - 1)
    assert got is None and traj.finish_reason == "truncated"
    # both: the tighter one decides
    traj, _, got = _first_append(tok, agent, room=n, max_total_tokens=exact - 1)
    assert got is None and traj.finish_reason == "truncated"
    traj, _, got = _first_append(tok, agent, room=n + 5, max_total_tokens=exact)
    assert got == app


# ---------------------------------------------------------------------- 4. a SentencePiece-style tokenizer
SP_SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SP_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n"
               "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def sentencepiece_tokenizer() -> Tokenizer:
    """A Unigram model under a Metaspace pre-tokenizer with prepend_scheme "first" (the SentencePiece style
    of converted tokenizers): "▁" is put before the first piece of the text only, so a suffix
    tokenized alone ("\\n...": "▁\\n") differs from the same text after a special token in context ("\\n")."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set(" \t\r\x0b\x0c"))
    words = ["user", "model", "tool", "▁is", "<tool", "_call>", "_response>", "</tool", "name", "arguments"]
    vocab = ([(s, 0.0) for s in SP_SPECIAL] + [("▁", -2.0)] + [(c, -5.0) for c in chars]
             + [("▁" + c, -4.0) for c in chars] + [(w, -3.0) for w in words])
    raw = RawTokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=False))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    raw.add_special_tokens(SP_SPECIAL)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<end_of_turn>",
                                 unk_token="<unk>", pad_token="<pad>")
    hf.chat_template = SP_TEMPLATE
    return Tokenizer(hf)


def test_appender_ids_equal_the_full_renderings_tokens_with_a_sentencepiece_tokenizer():
    tok = sentencepiece_tokenizer()
    [stop] = tok.eos_token_ids
    assert tok.hf.convert_ids_to_tokens(tok.encode("\nab cd", add_special_tokens=False))[0] == "▁\n"  # alone
    ap = ChatTemplateAppender(tok, [tool_from_callable(add)], name="sentencepiece")
    assert ap.tool_role == "tool" and ap.stop_texts == {stop: "<end_of_turn>"}
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    first = ap.prompt_messages(question)  # with the tools section
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    result = {"role": "tool", "name": "add", "content": "5"}
    follow_up = {"role": "user", "content": "And 5 + 5?\n Say it in words."}
    cases = [  # (messages before the model's turn, the new messages, whether the model stopped at its stop token)
        (first, [result], True),
        (first, [result], False),  # stopped at a stop string: the whole end of turn is appended
        (first, [result, follow_up], True),
        (first + [{"role": "assistant", "content": call}] + ap.convert([result]), [follow_up], True),
    ]
    for before, new, at_stop_token in cases:
        text = call if len(before) == len(first) else "It is  5 ."
        turn = tok.encode(text, add_special_tokens=False) + ([stop] if at_stop_token else [])
        appended = ap.append_ids(new, turn[-1])
        full = tok.apply_chat_template(before + [{"role": "assistant", "content": text}] + ap.convert(new),
                                       add_generation_prompt=True, tokenize=False)
        # the rendering up to where the model's tokens end (its stop token, or its last text token), then the
        # rest: in the full rendering's tokens the two are split at that special token
        cut = full.rindex(text) + len(text) + (len("<end_of_turn>") if at_stop_token else 0)
        head, every = tok.encode(full[:cut], add_special_tokens=False), tok.encode(full, add_special_tokens=False)
        assert every[:len(head)] == head
        assert appended == every[len(head):], (new, at_stop_token)
        assert tok.decode(appended, skip_special_tokens=False) == full[cut:]
        if at_stop_token:  # the premise: the same text tokenized on its own ("▁\n...") is not that
            assert tok.encode(full[cut:], add_special_tokens=False) != appended
    # the first prompt is the rendering's own tokens
    assert ap.prompt_ids(question) == tok.encode(tok.apply_chat_template(first, add_generation_prompt=True,
                                                                      tokenize=False), add_special_tokens=False)
