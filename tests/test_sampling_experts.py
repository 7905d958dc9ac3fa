"""Expert recording in the sampler (routing replay's sampler side): `generate(record_experts=True)` gives each
completion the experts the router chose at every position the sampler ran, equal to a single uncached forward of the
sequence; a dense model records nothing and compiles nothing new."""

from __future__ import annotations

import numpy as np
import pytest
from compile_counter import count_compiles

from posttrain.models import init_model
from posttrain.models.config import llama_like
from posttrain.models.tiny import tiny_config
from posttrain.sampling import ProgramCache, Sampler, SamplingParams, TurnEnd

VOCAB = 96
NEW = 6


@pytest.fixture(scope="module")
def moe():
    return init_model(tiny_config("tiny:qwen3_moe", vocab_size=VOCAB), seed=5)


@pytest.fixture(scope="module")
def programs():
    return ProgramCache()


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def _forward_experts(model, ids: list[int]) -> np.ndarray:
    """The experts one uncached forward of `ids` chooses [T, L_sparse, k]."""
    _, routing = model(np.asarray([ids], np.int32), routing=True)
    return np.asarray(routing.experts[0])


def _check(model, prompt: list[int], c) -> None:
    seq = list(prompt) + list(c.token_ids[:-1])
    got = c.routed_experts
    assert got is not None and got.dtype == np.int8
    assert got.shape == (len(seq), sum(model.cfg.moe_layers), model.cfg.num_experts_per_tok)
    np.testing.assert_array_equal(got, _forward_experts(model, seq))


@pytest.mark.slow
def test_greedy_recorded_experts_equal_one_uncached_forward(moe, programs):
    sampler = Sampler(moe, max_slots=8, program_cache=programs, segment_steps=4)  # several segments per sequence
    prompts = _prompts((5, 11, 3, 18))
    params = SamplingParams(max_new_tokens=NEW + 4, temperature=0.0, stop_token_ids=[])
    out = sampler.generate(prompts, params, record_experts=True)
    for prompt, c in zip(prompts, out):
        assert len(c.token_ids) == NEW + 4
        _check(moe, prompt, c)
    # off: the same tokens, nothing recorded
    plain = sampler.generate(prompts, params)
    assert [c.token_ids for c in plain] == [c.token_ids for c in out]
    assert all(c.routed_experts is None for c in plain)


@pytest.mark.slow
def test_samples_of_one_prompt_each_get_the_prompts_experts(moe, programs):
    sampler = Sampler(moe, max_slots=8, program_cache=programs)
    prompts = _prompts((7, 4), seed=1)
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, n=3, seed=11, stop_token_ids=[5, 9, 17, 40])
    out = sampler.generate(prompts, params, record_experts=True)
    assert len({tuple(c.token_ids) for c in out}) > 2  # the samples differ
    for c in out:
        _check(moe, prompts[c.prompt_index], c)


@pytest.mark.slow
def test_multi_turn_continuation_records_the_appended_ids(moe, programs):
    sampler = Sampler(moe, max_slots=8, program_cache=programs)
    prompts = _prompts((6, 13), seed=2)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=[])

    def on_turn_end(t: TurnEnd):
        if t.turn >= 2:
            return None
        return [3 + (t.prompt_index * 7 + t.turn * 5 + j) % (VOCAB - 3) for j in range(4 + 3 * t.turn)]

    out = sampler.generate(prompts, params, on_turn_end=on_turn_end, max_len=96, record_experts=True)
    for prompt, c in zip(prompts, out):
        assert c.turns == 3 and 0 in c.mask
        _check(moe, prompt, c)


def test_dense_model_records_nothing_and_compiles_nothing_new():
    model = init_model(llama_like(vocab_size=VOCAB, max_position_embeddings=64, num_layers=1), seed=0)
    sampler = Sampler(model, max_slots=8)
    prompts = _prompts((5, 9))
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    plain = sampler.generate(prompts, params)
    with count_compiles() as compiles:
        out = sampler.generate(prompts, params, record_experts=True)
    assert compiles.total == 0
    assert all(c.routed_experts is None for c in out)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
