"""Partial rollouts (`fleet.swap: segment`): a sampler swapping weights between decode segments of one call.

In process, no Ray: the tokens' versions change exactly at a segment boundary, each token's log-prob is the one
the weights (and kept KV cache) that produced it give, tokens before the swap are those of a call without it,
and the rollouts built from such completions carry per-token versions and a real version_first < version_last.
The fleet end to end is in tests/test_fleet.py (test_segment_swaps_...)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.models.attention import KVCache
from posttrain.models.tiny import tiny_config
from posttrain.models.transformer import init_model
from posttrain.sampling import Sampler, SamplingParams

SEG, NEW, SWAP_AFTER = 4, 18, 2  # segment steps, new tokens, segments run before the swap
PROMPTS = [[5, 9, 11, 3, 6], [7, 7, 2, 40, 1], [4, 20, 31, 8, 9]]  # one length: one reference program


@pytest.fixture(scope="module")
def policies():
    """(graphdef, v0 state, v1 state): a tiny Llama and the same with every parameter x1.5 (another policy)."""
    graphdef, state = nnx.split(init_model(tiny_config("llama", vocab_size=64), seed=0))
    return graphdef, state, jax.tree.map(lambda x: x * 1.5, state)


def _sampler(policies, version):
    """A sampler on v0's weights, loaded as `version` (committed arrays, as every later swap's are)."""
    graphdef, v0, _ = policies
    sampler = Sampler(nnx.clone(nnx.merge(graphdef, v0)), max_slots=8, segment_steps=SEG)  # swaps leave v0 as it is
    sampler.load_weights(v0, version)
    return sampler


@functools.partial(jax.jit, static_argnums=(0, 4))
def _mixed_logits(graphdef, early, late, ids, cut):
    """Logits of every position of ids [R, L] when inputs [0, cut) run through `early` weights (their cache
    kept) and the rest through `late` ones: what a swap keeps when its first new token is at input `cut`."""
    a, b = nnx.merge(graphdef, early), nnx.merge(graphdef, late)
    rows, n = ids.shape
    cache = KVCache.create(a.cfg, rows, n)
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (rows, n))
    lo, cache = a(ids[:, :cut], attention_mask=jnp.ones((rows, cut), bool), positions=pos[:, :cut], cache=cache)
    hi, _ = b(ids[:, cut:], attention_mask=jnp.ones((rows, n - cut), bool), positions=pos[:, cut:], cache=cache)
    return jnp.concatenate([lo, hi], axis=1)


def _logprobs(graphdef, early, late, completions, first_new):
    """Raw log-probs [R, NEW] of the completions' tokens when tokens from `first_new` on were produced by `late`
    (the cache up to the input before them by `early`)."""
    ids = np.asarray([PROMPTS[c.prompt_index] + c.token_ids for c in completions], np.int32)
    p = len(PROMPTS[0])
    logits = np.asarray(_mixed_logits(graphdef, early, late, ids, p + first_new - 1), np.float64)[:, p - 1:-1]
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    return np.take_along_axis(logp, ids[:, p:, None], axis=-1)[..., 0]


@pytest.mark.slow
def test_sampler_swaps_weights_at_a_segment_boundary_and_logprobs_follow_the_producing_version(policies):
    graphdef, v0, v1 = policies
    params = SamplingParams(n=2, max_new_tokens=NEW, temperature=1.0, seed=3, stop_token_ids=[])
    calls = []

    def between_segments():
        calls.append(1)
        return (v1, 1) if len(calls) == SWAP_AFTER else None

    sampler = _sampler(policies, 0)
    plain = sampler.generate(PROMPTS, params)  # the same call without a swap
    swapped = sampler.generate(PROMPTS, params, between_segments=between_segments)
    first_new = 1 + SWAP_AFTER * SEG  # the prefill's token, then SWAP_AFTER segments of SEG tokens
    assert sampler.version == 1 and sampler.last_stats["weight_swaps"] == 1
    assert len(calls) == -(-(NEW - 1) // SEG) - 1  # once between each two segments, never after the last
    for a, b in zip(plain, swapped):
        assert a.versions == [0] * NEW
        assert b.versions == [0] * first_new + [1] * (NEW - first_new)
        assert b.token_ids[:first_new] == a.token_ids[:first_new]  # the swap changes nothing before it
    np.testing.assert_allclose([b.logprobs[:first_new] for b in swapped],
                               [a.logprobs[:first_new] for a in plain], atol=1e-5)
    # every token's log-prob is the one of the weights that produced it (v1 after the swap, over v0's kept cache)
    np.testing.assert_allclose([b.logprobs for b in swapped], _logprobs(graphdef, v0, v1, swapped, first_new),
                               atol=1e-4)
    v0_only = _logprobs(graphdef, v0, v0, swapped, first_new)  # not what v0 gives for the same tokens
    assert np.abs(np.asarray([b.logprobs for b in swapped])[:, first_new:] - v0_only[:, first_new:]).min() > 0


def test_rollouts_carry_token_versions_and_their_span(policies):
    from posttrain.rollout.collect import generate_rollouts
    from posttrain.rollout.policy import Policy
    from posttrain.rollout.prompts import PromptSet

    sampler = _sampler(policies, 4)
    offered = iter([None, (policies[2], 5)])

    class Runner:
        def score(self, prompts, texts, fields):
            return np.zeros(len(texts)), {}, {}

    records = [{"prompt": "p"} for _ in PROMPTS]
    params = SamplingParams(n=2, max_new_tokens=NEW, temperature=1.0, seed=3, stop_token_ids=[])
    ro = generate_rollouts(Policy(sampler.model, None, sampler=sampler), PromptSet.of(records, PROMPTS), params,
                           Runner(), uids=[10, 11, 12], between_segments=lambda: next(offered, None))
    assert ro.version_first == [4] * 6 and ro.version_last == [5] * 6
    assert all(v == [4] * (1 + 2 * SEG) + [5] * (NEW - 1 - 2 * SEG) for v in ro.token_versions)
    assert ro.sampled_token_versions().tolist() == [v for row in ro.token_versions for v in row]
    g = ro.groups()[1]
    assert g.uid == [11, 11] and g.token_versions == ro.token_versions[2:4]
    assert ro.from_json(ro.to_json()).token_versions == ro.token_versions


def test_between_segments_offering_nothing_changes_nothing(policies):
    """A callback that never offers weights: the completions equal a call without one (same programs)."""
    sampler = _sampler(policies, None)
    params = SamplingParams(n=2, max_new_tokens=NEW, temperature=1.0, seed=3, stop_token_ids=[])
    a = sampler.generate(PROMPTS, params)
    b = sampler.generate(PROMPTS, params, between_segments=lambda: None)
    assert [c.token_ids for c in a] == [c.token_ids for c in b] and "weight_swaps" not in sampler.last_stats
    assert all(c.versions == [None] * NEW for c in b)
