"""Statistical checks: sampled tokens follow softmax(logits / T) after top-k / top-p / min-p, and nothing else.

Threshold. With N draws from p (support K), the empirical distribution q has
E[TV(p, q)] = 1/2 sum_i E|q_i - p_i| <= 1/2 sum_i sqrt(p_i (1 - p_i) / N) =: bound (Jensen). TV moves by at
most 1/N when one draw changes, so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 N t^2). We assert
TV < bound + t with t chosen so that exp(-2 N t^2) < 1e-3 (a false failure is that unlikely; the seeds are
fixed anyway), and check that this threshold is tight (< 0.05) and that the same test rejects a nearby wrong
distribution (no temperature, or no filter), so it can fail.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models import from_pretrained
from posttrain.sampling import Sampler, SamplingParams

PROMPT = [17, 40, 3, 88, 52, 9, 61, 23, 70, 11, 45]


def reference(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The sampling distribution, written independently of the engine (float64, explicit sorting)."""
    x = logits.astype(np.float64) / temperature
    keep = np.ones_like(x, bool)
    order = np.argsort(-x, kind="stable")
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        p = np.exp(x - x.max()) * keep
        p /= p.sum()
        mass_before = 0.0
        for i in order:
            if not keep[i]:
                continue
            if mass_before >= top_p:
                keep[i] = False
            mass_before += p[i]
    if min_p > 0.0:
        p = np.exp(x - x.max()) * keep
        p /= p.sum()
        keep &= p >= min_p * p.max()
    p = np.exp(x - x.max()) * keep
    return p / p.sum()


def threshold(p: np.ndarray, n: int) -> float:
    bound = 0.5 * np.sqrt(p * (1 - p) / n).sum()
    t = math.sqrt(math.log(1e3) / (2 * n))
    return bound + t


def empirical(tokens, vocab) -> np.ndarray:
    return np.bincount(np.asarray(tokens), minlength=vocab) / len(tokens)


@pytest.fixture(scope="module")
def setup(hf_checkpoint):
    model = from_pretrained(hf_checkpoint("llama"))
    logits = np.asarray(model(np.asarray([PROMPT])))[0, -1]
    return model, Sampler(model, max_slots=2048), logits


CASES = [
    dict(temperature=0.6),
    dict(temperature=1.6),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=1.5, min_p=0.3),
    dict(temperature=0.8, top_k=12, top_p=0.7),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.slow
def test_first_token_distribution(case, setup):
    model, sampler, logits = setup
    filtered = any(k in case for k in ("top_k", "top_p", "min_p"))
    n = 8192 if filtered else 32768
    out = sampler.generate([PROMPT], SamplingParams(max_new_tokens=1, n=n, seed=1, stop_token_ids=[], **case))
    assert len(out) == n and all(len(c.token_ids) == 1 for c in out)
    tokens = [c.token_ids[0] for c in out]
    p = reference(logits, **case)
    q = empirical(tokens, len(p))
    tol = threshold(p, n)
    assert tol < 0.05
    assert set(tokens) <= set(np.flatnonzero(p)), "a filtered-out token was sampled"
    tv = 0.5 * np.abs(p - q).sum()
    assert tv < tol, (tv, tol)
    # the test has power: the distribution without this case's temperature / filters is rejected
    wrong = reference(logits, temperature=1.0) if case.get("temperature") != 1.0 else reference(logits)
    assert 0.5 * np.abs(wrong - q).sum() > 2 * tol
    # reported log-probs: raw log-softmax, and the sampling distribution's
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    for c in out[:50]:
        assert abs(c.logprobs[0] - raw[c.token_ids[0]]) < 1e-4
        assert abs(c.sampling_logprobs[0] - np.log(p[c.token_ids[0]])) < 1e-4
    if filtered:
        assert len(set(tokens)) == np.count_nonzero(p)  # every kept token shows up (small supports)


def test_decode_step_distribution(setup):
    """The decode loop's draws (second token), conditioned on the most frequent first token."""
    model, sampler, logits = setup
    case = dict(temperature=0.9, top_k=4)
    n = 16384
    out = sampler.generate([PROMPT], SamplingParams(max_new_tokens=2, n=n, seed=2, stop_token_ids=[], **case))
    firsts = np.array([c.token_ids[0] for c in out])
    top = int(np.bincount(firsts).argmax())
    seconds = [c.token_ids[1] for c in out if c.token_ids[0] == top]
    m = len(seconds)
    assert m > 1000
    cond_logits = np.asarray(model(np.asarray([PROMPT + [top]])))[0, -1]
    p = reference(cond_logits, **case)
    q = empirical(seconds, len(p))
    tol = threshold(p, m)
    assert set(seconds) <= set(np.flatnonzero(p))
    assert 0.5 * np.abs(p - q).sum() < tol < 0.05
    assert 0.5 * np.abs(reference(cond_logits) - q).sum() > 2 * tol


def test_top_k_one_and_tiny_top_p_are_greedy(setup):
    model, sampler, logits = setup
    for case in (dict(top_k=1), dict(top_p=1e-6)):
        out = sampler.generate([PROMPT], SamplingParams(max_new_tokens=1, n=2048, seed=3, temperature=1.3, **case))
        assert {c.token_ids[0] for c in out} == {int(np.argmax(logits))}
        assert all(abs(c.sampling_logprobs[0]) < 1e-6 for c in out)


@pytest.mark.parametrize("vocab", [7, 64, 1000])
def test_inverse_cdf_sampler_matches_softmax_on_a_grid(vocab):
    """`sample_categorical` at u on a fine uniform grid hits each index in proportion to its probability
    (exactly, up to one grid cell), never an entry at -inf, also at u just below 1 and for vocab sizes that
    are not a multiple of its block size."""
    from posttrain.models.kernels import sample_categorical

    rng = np.random.default_rng(vocab)
    x = rng.normal(size=vocab).astype(np.float32) * 2
    x[rng.permutation(vocab)[: vocab // 3]] = -np.inf  # filtered tokens
    x[-1] = -np.inf  # the last entry too: a draw must not fall off the end onto it
    n = 20000
    u = (np.arange(n, dtype=np.float64) + 0.5) / n
    u = np.concatenate([u, [0.0, 1.0 - 2.0**-24]]).astype(np.float32)
    tok, lse = jax.jit(sample_categorical)(jnp.tile(jnp.asarray(x)[None], (len(u), 1)), jnp.asarray(u))
    tok = np.asarray(tok)
    assert np.all(np.isfinite(x[tok])), "a filtered (-inf) entry was drawn"
    p = np.exp(x - x.max())
    p /= p.sum()
    freq = np.bincount(tok[:n], minlength=vocab) / n
    assert np.abs(freq - p).max() <= 2.0 / n + 1e-5
    np.testing.assert_allclose(np.asarray(lse)[0], np.log(np.sum(np.exp(x[np.isfinite(x)] - x.max()))) + x.max(),
                               rtol=1e-5)
