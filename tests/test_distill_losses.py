"""Distillation losses (`posttrain.algorithms.distill`) against hand-computed values and TRL's GKD
`generalized_jsd_loss` (values and gradients, to 1e-5)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.algorithms.distill import (DIVERGENCES, distill_token_loss, make_token_loss, teacher_topk,
                                          token_divergence, topk_token_divergence)

pytestmark = pytest.mark.full_optimization  # numbers against a reference: compiled as users' runs are (tests/conftest.py)

LN = math.log
P = [0.5, 0.25, 0.25]  # teacher
Q = [0.25, 0.5, 0.25]  # student


def logits(probs):
    return jnp.log(jnp.asarray(probs, jnp.float32))


def test_divergences_hand_values():
    s, t = logits(Q), logits(P)
    # KL(p||q) = .5 ln(.5/.25) + .25 ln(.25/.5) = .25 ln 2 ; KL(q||p) = .25 ln(.5) + .5 ln 2 = .25 ln 2
    assert float(token_divergence(s, t, kind="forward_kl")) == pytest.approx(0.25 * LN(2), abs=1e-6)
    assert float(token_divergence(s, t, kind="reverse_kl")) == pytest.approx(0.25 * LN(2), abs=1e-6)
    # m = [.375, .375, .25]: .5 KL(p||m) + .5 KL(q||m), each .5 ln(4/3) + .25 ln(2/3)
    jsd = 0.5 * LN(4 / 3) + 0.25 * LN(2 / 3)
    assert float(token_divergence(s, t, kind="jsd", beta=0.5)) == pytest.approx(jsd, abs=1e-6)
    # beta = 0.2: m = .2 p + .8 q = [.3, .45, .25]
    m = [0.3, 0.45, 0.25]
    want = 0.2 * sum(p * LN(p / x) for p, x in zip(P, m)) + 0.8 * sum(q * LN(q / x) for q, x in zip(Q, m))
    assert float(token_divergence(s, t, kind="jsd", beta=0.2)) == pytest.approx(want, abs=1e-6)
    # asymmetric case: forward and reverse differ
    p2, q2 = [0.7, 0.2, 0.1], [0.1, 0.3, 0.6]
    fwd = sum(p * LN(p / q) for p, q in zip(p2, q2))
    rev = sum(q * LN(q / p) for p, q in zip(p2, q2))
    assert float(token_divergence(logits(q2), logits(p2), kind="forward_kl")) == pytest.approx(fwd, abs=1e-6)
    assert float(token_divergence(logits(q2), logits(p2), kind="reverse_kl")) == pytest.approx(rev, abs=1e-6)
    assert abs(fwd - rev) > 0.05


def test_temperature_softens_and_scales_by_t_squared():
    s, t = logits(Q), logits(P)
    # T = 2: probabilities ∝ sqrt(p)
    pt = np.sqrt(P) / np.sqrt(P).sum()
    qt = np.sqrt(Q) / np.sqrt(Q).sum()
    want = 4.0 * sum(p * LN(p / q) for p, q in zip(pt, qt))
    assert float(token_divergence(s, t, kind="forward_kl", temperature=2.0)) == pytest.approx(want, abs=1e-6)


def test_topk_renormalised_on_the_teachers_support():
    p, q = [0.5, 0.3, 0.2], [0.25, 0.5, 0.25]
    logp, ids = teacher_topk(logits(p), 2)
    assert ids.tolist() == [0, 1] and np.allclose(np.exp(logp), [0.5, 0.3])
    # support {0, 1}: p~ = [.625, .375], q~ = [1/3, 2/3]
    want = 0.625 * LN(0.625 * 3) + 0.375 * LN(0.375 * 1.5)
    got = topk_token_divergence(logits(q), logp, ids, kind="forward_kl")
    assert float(got) == pytest.approx(want, abs=1e-6)
    # a student equal to the teacher on the support (whatever it puts elsewhere) has zero renormalised loss
    s_same = jnp.asarray([[0.0, LN(0.3 / 0.5), 5.0]])  # ratio on {0, 1} as the teacher's, large mass on 2
    same = topk_token_divergence(s_same, logp[None], ids[None], kind="reverse_kl")
    assert float(same[0]) == pytest.approx(0, abs=1e-6)


def test_topk_with_the_rest_of_the_mass():
    p, q = [0.5, 0.3, 0.15, 0.05], [0.25, 0.5, 0.05, 0.2]
    logp, ids = teacher_topk(logits(p), 2)
    # outcomes {0, 1, rest}: p' = [.5, .3, .2], q' = [.25, .5, .25]
    pp, qq = [0.5, 0.3, 0.2], [0.25, 0.5, 0.25]
    fwd = sum(a * LN(a / b) for a, b in zip(pp, qq))
    rev = sum(b * LN(b / a) for a, b in zip(pp, qq))
    for kind, want in (("forward_kl", fwd), ("reverse_kl", rev)):
        assert float(topk_token_divergence(logits(q), logp, ids, kind=kind, tail=True)) == pytest.approx(want, abs=1e-6)
    # the student's mass off the support is penalised (unlike the renormalised loss)
    s_same = jnp.asarray([0.0, LN(0.3 / 0.5), 5.0, 5.0])
    assert float(topk_token_divergence(s_same, logp, ids, kind="forward_kl", tail=True)) > 0.5
    assert float(topk_token_divergence(s_same, logp, ids, kind="forward_kl")) == pytest.approx(0, abs=1e-6)
    # not more than the full divergence
    full = float(token_divergence(logits(q), logits(p), kind="forward_kl"))
    assert fwd <= full + 1e-9


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.slow
def test_topk_with_k_equal_v_is_the_full_loss(tail):
    rng = np.random.default_rng(0)
    s, t = jnp.asarray(rng.normal(size=(4, 7)), jnp.float32), jnp.asarray(rng.normal(size=(4, 7)), jnp.float32)
    lp, i = teacher_topk(t, 7, temperature=1.5)
    for kind in DIVERGENCES:
        np.testing.assert_allclose(topk_token_divergence(s, lp, i, kind=kind, beta=0.3, temperature=1.5, tail=tail),
                                   token_divergence(s, t, kind=kind, beta=0.3, temperature=1.5),
                                   atol=5e-5 if tail else 1e-5)  # tail: float32's ~1e-7 "rest" at k = V
    g = jax.grad(lambda x: topk_token_divergence(x, lp, i, kind="jsd", temperature=1.5, tail=tail).sum())(s)
    g_full = jax.grad(lambda x: token_divergence(x, t, kind="jsd", temperature=1.5).sum())(s)
    np.testing.assert_allclose(g, g_full, atol=1e-5)


def test_alpha_mixes_cross_entropy():
    s, t = logits(Q), logits(P)
    loss, d, ce = distill_token_loss(s, jnp.asarray(1), {"logits": t}, kind="forward_kl", alpha=0.25)
    assert float(ce) == pytest.approx(LN(2), abs=1e-6)  # -log q[1] = -log .5
    assert float(loss) == pytest.approx(0.25 * 0.25 * LN(2) + 0.75 * LN(2), abs=1e-6)
    # T only softens the divergence: CE stays at T = 1
    loss2, d2, ce2 = distill_token_loss(s, jnp.asarray(1), {"logits": t}, alpha=0.5, temperature=3.0)
    assert float(ce2) == pytest.approx(LN(2), abs=1e-6) and float(loss2) == pytest.approx(0.5 * float(d2) + 0.5 * LN(2))


def test_settings_checked():
    with pytest.raises(ValueError, match="accepted: \\['forward_kl', 'jsd', 'reverse_kl'\\]"):
        make_token_loss("kl")
    with pytest.raises(ValueError, match="temperature"):
        make_token_loss("jsd", temperature=0.0)
    with pytest.raises(ValueError, match="alpha"):
        make_token_loss("jsd", alpha=1.5)


def test_teacher_gets_no_gradient():
    s, t = logits(Q), logits(P)
    g = jax.grad(lambda tt: token_divergence(s, tt, kind="jsd", beta=0.4))(t)
    assert float(jnp.abs(g).max()) == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.slow
def test_generalized_jsd_equals_trl(beta, temperature):
    """TRL's GKD loss (mean over the unmasked tokens) and its gradient w.r.t. the student logits; TRL has no
    T^2 factor, so ours is divided by T^2."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDTrainer

    rng = np.random.default_rng(1)
    s = rng.normal(size=(2, 5, 11)).astype(np.float32) * 2
    t = rng.normal(size=(2, 5, 11)).astype(np.float32) * 2
    labels = np.array([[-100, 3, 4, -100, 1], [2, 2, -100, 5, 6]])
    mask = (labels != -100).astype(np.float32)

    s_t = torch.tensor(s, requires_grad=True)
    ref = GKDTrainer.generalized_jsd_loss(s_t, torch.tensor(t), labels=torch.tensor(labels), beta=beta,
                                          temperature=temperature)
    ref.backward()

    kind = "jsd"

    def ours(x):
        per_tok = token_divergence(x, jnp.asarray(t), kind=kind, beta=beta, temperature=temperature)
        return jnp.sum(per_tok * mask) / mask.sum() / temperature**2

    val, grad = jax.value_and_grad(ours)(jnp.asarray(s))
    assert float(val) == pytest.approx(float(ref), abs=1e-5)
    np.testing.assert_allclose(np.asarray(grad), s_t.grad.numpy(), atol=1e-5)
    if beta in (0.0, 1.0):  # the two ends are the plain KLs
        name = "forward_kl" if beta == 0.0 else "reverse_kl"
        np.testing.assert_allclose(token_divergence(jnp.asarray(s), jnp.asarray(t), kind=name, temperature=temperature),
                                   token_divergence(jnp.asarray(s), jnp.asarray(t), kind=kind, beta=beta,
                                                    temperature=temperature), atol=1e-6)
