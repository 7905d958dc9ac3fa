"""Pins of the sampler's multi-turn continuation (issue 41): when only some slots resume after a tool result (others
finished), each resumed turn's first token is its own slot's (the extend step's output is by row, not by slot),
so the tokens equal generation from scratch; and the `room` a turn end reports bounds an append exactly."""

from __future__ import annotations

import numpy as np
import pytest

from posttrain.models import init_model
from posttrain.models.config import llama_like
from posttrain.sampling import Sampler, SamplingParams, TurnEnd

VOCAB = 96
NEW = 4


@pytest.fixture(scope="module")
def model():
    return init_model(llama_like(vocab_size=VOCAB, max_position_embeddings=128, num_layers=1), seed=3)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def _tool(prompt: int) -> list[int]:
    """What a fake tool appends after prompt `prompt`'s first turn (lengths 3, 5, 7, ...)."""
    return [3 + (prompt * 11 + j * 5) % (VOCAB - 3) for j in range(3 + 2 * prompt)]


@pytest.mark.slow
def test_resumed_slots_but_not_all_equal_generation_from_scratch(model):
    """Prompt 0 stops after its first turn; prompts 1..3 resume after a tool result, in one extend call whose
    rows (0, 1, 2) are not their slots (1, 2, 3)."""
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
    prompts = _prompts((5, 9, 3, 12))
    ends: list[TurnEnd] = []

    def on_turn_end(t: TurnEnd):
        ends.append(t)
        return None if t.prompt_index == 0 or t.turn >= 1 else _tool(t.prompt_index)

    sampler = Sampler(model, max_slots=4)
    out = sampler.generate(prompts, params, on_turn_end=on_turn_end, max_len=64)
    assert sampler.last_stats["continuation_calls"] == 1  # the three resumed together
    assert [c.turns for c in out] == [1, 2, 2, 2]
    first = sampler.generate(prompts, params)  # from scratch: the first turns, then the second ones
    second = sampler.generate([p + f.token_ids + _tool(i) for i, (p, f) in enumerate(zip(prompts, first)) if i],
                              params)
    assert out[0].token_ids == first[0].token_ids and out[0].mask == [1] * NEW
    for i in (1, 2, 3):
        want = first[i].token_ids + _tool(i) + second[i - 1].token_ids
        assert out[i].token_ids == want, i
        assert out[i].mask == [1] * NEW + [0] * len(_tool(i)) + [1] * NEW
        np.testing.assert_allclose(out[i].logprobs[-NEW:], second[i - 1].logprobs, atol=1e-5)
    # the turn ends saw the same second turns
    assert {t.prompt_index: t.token_ids for t in ends if t.turn == 1} == {i: second[i - 1].token_ids for i in (1, 2, 3)}


@pytest.mark.slow
def test_room_is_what_an_append_may_hold_up_to_the_context_limit(model):
    """A turn end's room is max_len - length - 1: an append of exactly that many ids leaves one position, which the
    next turn's first token fills (that turn ends at the limit with room 0); one id more is refused."""
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])
    limit, prompt = 24, _prompts((6,))
    ends: list[TurnEnd] = []

    def fill(t: TurnEnd):
        ends.append(t)
        return [7] * t.room if t.room else None

    out = Sampler(model, max_slots=1).generate(prompt, params, on_turn_end=fill, max_len=limit)
    assert [(t.length, t.room) for t in ends] == [(6 + NEW, limit - 6 - NEW - 1), (limit, 0)]
    [c] = out
    assert len(c.token_ids) == limit - 6 and c.mask == [1] * NEW + [0] * (limit - 6 - NEW - 1) + [1]
    assert c.turns == 2 and c.finish_reason == "length"
    with pytest.raises(ValueError, match=rf"appended {limit - 6 - NEW} ids .* only {limit - 6 - NEW - 1} fit"):
        Sampler(model, max_slots=1).generate(prompt, params, on_turn_end=lambda t: [7] * (t.room + 1),
                                             max_len=limit)
