"""SFT loss: masking and normalisation against hand-computed values, gradient accumulation, chunked == plain."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain.algorithms.sft import cross_entropy, make_sft_loss, sft_loss, sft_weight, token_logprobs
from posttrain.models.config import llama_like
from posttrain.models.transformer import init_model
from posttrain.training.trainer import Trainer, reduce_metrics

pytestmark = pytest.mark.full_optimization  # numbers against a reference: compiled as users' runs are (tests/conftest.py)

LN2, LN3, LN4 = math.log(2), math.log(3), math.log(4)


@pytest.mark.slow
def test_cross_entropy_hand_values():
    # One sequence, V=3. Position t scores token t+1 and is weighted by loss_mask[t+1].
    logits = jnp.array([[[0.0, 0.0, 0.0],           # predicts ids[1]=1: p=1/3 -> ln 3
                         [0.0, 0.0, LN2],           # predicts ids[2]=2: p=2/4 -> ln 2
                         [5.0, -3.0, 1.0],          # predicts ids[3]=0: masked out
                         [9.0, 9.0, 9.0]]])         # last position predicts nothing
    ids = jnp.array([[0, 1, 2, 0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])       # mask[0] is never used (nothing predicts token 0)
    total, count = cross_entropy(logits, ids, mask)
    assert float(count) == 2.0
    np.testing.assert_allclose(float(total), LN3 + LN2, rtol=1e-6)
    np.testing.assert_allclose(float(total / count), math.log(6) / 2, rtol=1e-6)
    # Changing anything at masked positions changes nothing.
    logits2 = logits.at[0, 2].set(jnp.array([-7.0, 2.0, 0.5])).at[0, 3].set(0.0)
    ids2 = ids.at[0, 3].set(2)
    np.testing.assert_allclose(float(cross_entropy(logits2, ids2, mask)[0]), LN3 + LN2, rtol=1e-6)
    # ...and unmasking the third target adds its hand value, -log softmax([5,-3,1])[0].
    full = cross_entropy(logits, ids, jnp.ones_like(mask))[0]
    third = -(5.0 - math.log(math.exp(5) + math.exp(-3) + math.exp(1)))
    np.testing.assert_allclose(float(full), LN3 + LN2 + third, rtol=1e-6)


class Bigram(nnx.Module):
    """logits[b, t] = W[input_ids[b, t]]: a model whose logits are a parameter table written by hand."""

    def __init__(self, table):
        self.table = nnx.Param(jnp.asarray(table, jnp.float32))

    def hidden_states(self, input_ids, **_):
        return jax.nn.one_hot(input_ids, self.table.shape[0]), None

    def logits(self, h):
        return h @ self.table[...]


# W[0] = [0, ln2, 0], W[1] = [0, 0, ln2], W[2] = [ln2, 0, 0]: the "preferred" next token has p=1/2, others 1/4.
TABLE = np.array([[0.0, LN2, 0.0], [0.0, 0.0, LN2], [LN2, 0.0, 0.0]])
# Row A: one target, 0 -> 2 with p=1/4 (NLL ln 4). Row B: three targets 1->2, 2->0, 0->1, each p=1/2 (NLL ln 2).
BATCH = {
    "input_ids": np.array([[0, 2, 0, 0], [1, 2, 0, 1]], np.int32),
    "loss_mask": np.array([[0, 1, 0, 0], [0, 1, 1, 1]], np.float32),
}
TOKEN_MEAN = (LN4 + 3 * LN2) / 4       # 5 ln2 / 4 = 0.8664: mean over the 4 real targets of the whole batch
MICRO_MEAN = (LN4 / 1 + 3 * LN2 / 3) / 2  # 3 ln2 / 2 = 1.0397: mean of per-row (per-micro-batch) means


def _bigram_trainer(grad_accum, loss_fn, lr=1.0):
    return Trainer(Bigram(TABLE), optax.sgd(lr), loss_fn=loss_fn, grad_accum=grad_accum, donate=False)


def test_sft_loss_hand_values_on_bigram():
    total, count, metrics = sft_loss(Bigram(TABLE), {k: jnp.asarray(v) for k, v in BATCH.items()})
    np.testing.assert_allclose(float(total), LN4 + 3 * LN2, rtol=1e-6)
    assert float(count) == 4.0 == float(sft_weight(BATCH)) == float(metrics["target_tokens"])


def test_token_mean_over_accumulated_batch_matches_unaccumulated():
    loss_fn = make_sft_loss()
    one = _bigram_trainer(1, loss_fn)
    two = _bigram_trainer(2, loss_fn)  # micro-batches: row A alone, row B alone
    m1, m2 = one.step(BATCH), two.step(BATCH)
    np.testing.assert_allclose(m1["loss"], TOKEN_MEAN, rtol=1e-6)
    np.testing.assert_allclose(m2["loss"], TOKEN_MEAN, rtol=1e-6)
    assert m2["weight"] == 4.0 and m2["target_tokens"] == 4.0
    # The parameters after one SGD step (lr=1) equal W - grad of the globally normalised loss in both.
    w1, w2 = np.asarray(one.params["table"][...]), np.asarray(two.params["table"][...])
    np.testing.assert_allclose(w1, w2, atol=1e-7)
    # Hand gradient of row 1 of W: only B's 1->2 target uses it: (softmax(W[1]) - onehot(2)) / 4.
    p = np.exp(TABLE[1]) / np.exp(TABLE[1]).sum()
    np.testing.assert_allclose(w1[1], TABLE[1] - (p - np.eye(3)[2]) / 4, rtol=1e-6)


def test_per_micro_batch_mean_would_differ():
    """The same batch normalised per micro-batch gives another number: the test above would catch it."""

    def per_micro_mean(model, mb):  # a wrong normalisation: each micro-batch's own token mean, weight 1
        s, c, _ = sft_loss(model, mb)
        return s / c, jnp.ones(()), {}

    wrong = _bigram_trainer(2, per_micro_mean).step(BATCH)["loss"]
    np.testing.assert_allclose(wrong, MICRO_MEAN, rtol=1e-6)
    assert abs(wrong - TOKEN_MEAN) > 0.1


def test_metric_reduction_rules():
    out = reduce_metrics({"count": jnp.array(6.0), "frac": (jnp.array(3.0), jnp.array(4.0))})
    assert float(out["count"]) == 6.0 and float(out["frac"]) == 0.75


def _batch(rng, b, t, vocab):
    ids = rng.integers(3, vocab, size=(b, t)).astype(np.int32)
    mask = (rng.random((b, t)) < 0.6).astype(np.float32)
    return {"input_ids": jnp.asarray(ids), "loss_mask": jnp.asarray(mask)}


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.slow
def test_chunked_equals_plain(softcap):
    cfg = llama_like(vocab_size=96, num_layers=1, final_logit_softcap=softcap)
    model = init_model(cfg, seed=3)
    batch = _batch(np.random.default_rng(0), 3, 11, 96)
    plain_sum, plain_count = cross_entropy(model(batch["input_ids"]), batch["input_ids"], batch["loss_mask"])
    graphdef, params = nnx.split(model)

    def loss(p, chunk):
        s, c, _ = sft_loss(nnx.merge(graphdef, p), batch, chunk_size=chunk)
        return s / c

    vg = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    ref_val, ref_grad = vg(params, None)
    np.testing.assert_allclose(float(ref_val), float(plain_sum / plain_count), rtol=1e-6)
    # 30 target positions: one per chunk, and chunks of 7 (the last one padded).
    for chunk in ((1, 7) if softcap is None else (7,)):
        val, grad = vg(params, chunk)
        np.testing.assert_allclose(float(val), float(ref_val), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_token_logprobs_match_log_softmax():
    model = init_model(llama_like(vocab_size=64, num_layers=1), seed=1)
    ids = _batch(np.random.default_rng(1), 2, 9, 64)["input_ids"]
    ref = jax.nn.log_softmax(model(ids), axis=-1)[:, :-1]
    ref = jnp.take_along_axis(ref, ids[:, 1:, None], axis=-1)[..., 0]
    for chunk in (None, 5):
        got = token_logprobs(model, ids, chunk_size=chunk)
        assert got.shape == (2, 8)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)


@pytest.mark.slow
def test_logprobs_from_logits_gradient_matches_autodiff_of_log_softmax():
    """The hand-written backward (g * (onehot - softmax)) equals autodiff of log_softmax + gather."""
    import jax
    import jax.numpy as jnp

    from posttrain.algorithms.sft import logprobs_from_logits

    logits = jax.random.normal(jax.random.key(0), (3, 5, 11)) * 3
    targets = jax.random.randint(jax.random.key(1), (3, 5), 0, 11)
    g = jax.random.normal(jax.random.key(2), (3, 5))

    def ref(x):
        lp = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), targets[..., None], axis=-1)[..., 0]
        return jnp.sum(lp * g)

    ours = lambda x: jnp.sum(logprobs_from_logits(x, targets) * g)  # noqa: E731
    np.testing.assert_allclose(ours(logits), ref(logits), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(ours))(logits), jax.grad(ref)(logits), rtol=1e-5, atol=1e-6)


def test_logprobs_and_entropy_values_and_gradient():
    import jax
    import jax.numpy as jnp

    from posttrain.algorithms.sft import logprobs_and_entropy

    logits = jax.random.normal(jax.random.key(3), (4, 13)) * 2
    targets = jnp.array([0, 5, 12, 7])
    lp, ent = logprobs_and_entropy(logits, targets)
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(lp, logp_all[jnp.arange(4), targets], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1), rtol=1e-5)
    g = jnp.array([0.5, -1.0, 2.0, 0.0])
    ours = jax.grad(lambda x: jnp.sum(logprobs_and_entropy(x, targets)[0] * g))(logits)
    ref = jax.grad(lambda x: jnp.sum(logp_all_of(x)[jnp.arange(4), targets] * g))(logits)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


def logp_all_of(x):
    import jax

    return jax.nn.log_softmax(x, axis=-1)
