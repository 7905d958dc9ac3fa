"""The rollout correction (issue 51), by hand: truncated and masked importance weights at the token, sequence and
geometric levels, rejection at each level, masked tokens leaving numerator and denominator of every aggregation
(slime#657's five tokens, three masked: the mean is over two), the settings' checks, and the correction through the
RL loss (the micro-batch weight counts what the loss counts; packed rows carry the weights)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.algorithms.correction import RolloutCorrection, masked_tokens, rollout_correction
from posttrain.algorithms.policy import policy_loss

pytestmark = pytest.mark.full_optimization  # numbers against hand computations: compiled as users' runs are


def _correct(old, mu, mask, **settings):
    w, m = rollout_correction(jnp.asarray(old, jnp.float32), jnp.asarray(mu, jnp.float32),
                              jnp.asarray(mask, jnp.float32), RolloutCorrection(**settings))
    return np.asarray(w), {k: float(v) for k, v in m.items()}


# ---------------------------------------------------------------------- slime#657: 5 tokens, 3 masked
X = np.array([[1.0, 2.0, 3.0, 4.0, 5.0],   # the five tokens' losses (row 0: slime#657's case)
              [10.0, 20.0, 0.0, 0.0, 0.0],  # a clean sequence of two tokens
              [7.0, 7.0, 7.0, 0.0, 0.0]])   # a sequence every token of which is masked
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], np.float32)
# log(pi_old / mu): row 0's ratios 3, 1, 0.1, 1, 5 (three outside [0.5, 2]); row 1 on policy; row 2 all at 5
LOG_R = np.log(np.array([[3.0, 1.0, 0.1, 1.0, 5.0], [1.0, 1.0, 1.0, 1.0, 1.0], [5.0, 5.0, 5.0, 1.0, 1.0]]))
MU = np.full(X.shape, -1.0, np.float32)
OLD = (MU + LOG_R).astype(np.float32)


def _loss(aggregation, weights, **kw):
    """policy_loss with ratio 1 (logp = old) and per-token advantages -X: each token's surrogate is its X (the
    first rows, as many as `weights` has)."""
    n = len(weights)
    loss, _ = policy_loss(jnp.asarray(OLD[:n]), jnp.asarray(OLD[:n]), jnp.asarray(-X[:n]), jnp.asarray(MASK[:n]),
                          aggregation=aggregation, is_weights=weights, **kw)
    return float(loss)


def test_masked_tokens_leave_the_denominator_of_token_mean_slime_657():
    w, m = _correct(OLD[:1], MU[:1], MASK[:1], is_mode="mask", is_low=0.5, is_cap=2.0)
    np.testing.assert_allclose(w, [[0.0, 1.0, 0.0, 1.0, 0.0]], atol=1e-6)
    assert _loss("token_mean", jnp.asarray(w)) == pytest.approx((2.0 + 4.0) / 2)  # not (2 + 4) / 5
    assert m["is/masked_frac"] == pytest.approx(3 / 5) and m["is/rejected_seq_frac"] == 0.0
    assert (m["is/ratio_min"], m["is/ratio_max"]) == (pytest.approx(0.1), pytest.approx(5.0))


def test_masked_tokens_and_sequences_leave_every_aggregation():
    """Token-level MIS over the three rows: row 0 keeps tokens 2 and 4, row 1 both, row 2 none (it leaves the
    sequence counts too)."""
    w, m = _correct(OLD, MU, MASK, is_mode="mask", is_low=0.5, is_cap=2.0)
    kept = np.array([[0, 1, 0, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], np.float32)
    np.testing.assert_allclose(w, kept, atol=1e-6)
    assert m["is/masked_frac"] == pytest.approx(6 / 10) and m["is/rejected_seq_frac"] == pytest.approx(1 / 3)
    assert _loss("token_mean", jnp.asarray(w)) == pytest.approx(36 / 4)
    assert _loss("seq_mean_token_mean", jnp.asarray(w)) == pytest.approx((3.0 + 15.0) / 2)  # row 2 is no sequence
    # Dr. GRPO: sum over N * max_tokens with N the sequences left (2, not 3)
    assert _loss("seq_mean_token_sum_norm", jnp.asarray(w), max_tokens=5) == pytest.approx(36 / (2 * 5))
    mask, n = masked_tokens(MASK, w)
    np.testing.assert_array_equal(np.asarray(mask), kept)
    assert float(n) == 2.0
    # packed rows (num_sequences given: empty slots are no sequences) lose the rejected one the same way
    assert float(masked_tokens(MASK, w, num_sequences=3.0)[1]) == 2.0
    assert masked_tokens(MASK, None, None) == (MASK, None)


def test_sequence_level_masked_importance_sampling():
    """Seq-MIS: one ratio per sequence (the product of its token ratios), masked outside [low, cap]: row 0's
    product 3 * 0.1 * 5 = 1.5 is kept (weight 1.5 on each token), row 2's 125 leaves with all its tokens."""
    w, m = _correct(OLD, MU, MASK, is_level="sequence", is_mode="mask", is_low=0.5, is_cap=2.0)
    np.testing.assert_allclose(w[0], [1.5] * 5, rtol=1e-5)
    np.testing.assert_allclose(w[1], [1, 1, 0, 0, 0], rtol=1e-6)
    np.testing.assert_array_equal(w[2], 0)
    assert m["is/rejected_seq_frac"] == pytest.approx(1 / 3) and m["is/masked_frac"] == pytest.approx(3 / 10)
    assert (m["is/ratio_min"], m["is/ratio_max"]) == (pytest.approx(1.0), pytest.approx(125.0, rel=1e-5))
    assert _loss("token_mean", jnp.asarray(w)) == pytest.approx((1.5 * 15 + 30) / 7, rel=1e-6)
    assert _loss("seq_mean_token_mean", jnp.asarray(w)) == pytest.approx((1.5 * 3 + 15) / 2, rel=1e-6)


def test_truncated_importance_weights_hand_computed():
    old = np.array([[-1.0, -2.0, 0.0]])
    behaviour = np.array([[-1.5, -1.0, 5.0]])
    mask = np.array([[1.0, 1.0, 0.0]])  # the third token is padding
    r = np.exp([0.5, -1.0])
    w, m = _correct(old, behaviour, mask, is_level="token", is_cap=1.5)
    np.testing.assert_allclose(w[0], [1.5, r[1], 0.0], rtol=1e-6)
    assert m["is/truncated_frac"] == 0.5 and m["is/masked_frac"] == 0.0
    assert m["mismatch_kl"] == pytest.approx(np.mean(r - 1 - np.log(r)), rel=1e-6)
    assert m["is/ess"] == pytest.approx((1.5 + r[1]) ** 2 / (2 * (1.5**2 + r[1] ** 2)), rel=1e-6)
    ws, ms = _correct(old, behaviour, mask, is_level="sequence", is_cap=2.0)
    np.testing.assert_allclose(ws[0, :2], [np.exp(-0.5)] * 2, rtol=1e-6)
    assert ms["is/ess"] == pytest.approx(1.0)  # one sequence
    wg, mg = _correct(old, behaviour, mask, is_level="geometric", is_cap=2.0)
    np.testing.assert_allclose(wg[0, :2], [np.exp(-0.25)] * 2, rtol=1e-6)  # exp(mean of 0.5 and -1)


@pytest.mark.slow
def test_mismatch_kl_does_not_round_a_small_mismatch_to_zero():
    """float32 log-probs that differ by a few ulps (a matched float32 run): r - 1 - log r computed as written in
    float32 is ~1e-12 under rounding of 1.2e-7 (the run logged 0.0); the metric is the float64 value to 1e-6, across
    the series' threshold (|log r| = 0.1) too."""
    mu = np.array([[-2.3456789, -0.5, -7.25, -1.0]], np.float32)
    old = (mu + np.array([[1.430511474609375e-06, -2.4e-7, 0.09, 0.3]], np.float32)).astype(np.float32)
    x = old.astype(np.float64) - mu.astype(np.float64)
    want = np.mean(np.expm1(x) - x)
    assert _correct(old, mu, np.ones_like(mu))[1]["mismatch_kl"] == pytest.approx(want, rel=1e-5)
    small = _correct(old[:, :2], mu[:, :2], np.ones((1, 2), np.float32))[1]["mismatch_kl"]
    assert small == pytest.approx(np.mean(np.expm1(x[:, :2]) - x[:, :2]), rel=1e-5) and small > 0


@pytest.mark.slow
def test_weights_scale_the_surrogate_and_are_constants():
    logp = jnp.array([[-1.0, -2.0], [-0.5, -0.7]])
    adv, mask = jnp.array([1.0, -2.0]), jnp.ones((2, 2))
    plain, _ = policy_loss(logp, logp, adv, mask)
    w_same, _ = rollout_correction(logp, logp, mask, RolloutCorrection())  # sampler == trainer: weights exactly 1
    assert float(policy_loss(logp, logp, adv, mask, is_weights=w_same)[0]) == float(plain)
    behaviour = logp - jnp.array([[0.1, -0.2], [0.3, 0.0]])  # log(pi_old / mu) = [[0.1, -0.2], [0.3, 0]]
    w, _ = rollout_correction(logp, behaviour, mask, RolloutCorrection(is_cap=1.2))
    expected_w = np.minimum(np.exp([[0.1, -0.2], [0.3, 0.0]]), 1.2)
    np.testing.assert_allclose(np.asarray(w), expected_w, rtol=1e-6)
    corrected, _ = policy_loss(logp, logp, adv, mask, is_weights=w)
    np.testing.assert_allclose(float(corrected), np.mean(-np.asarray(adv)[:, None] * expected_w), rtol=1e-6)
    g = jax.grad(lambda lp: policy_loss(lp, logp, adv, mask, is_weights=w)[0])(logp)
    np.testing.assert_allclose(np.asarray(g), -np.asarray(adv)[:, None] * expected_w / 4, rtol=1e-5)


# ---------------------------------------------------------------------- rejection, each level by hand
REJ_LOG_R = np.array([[0.1, -0.2, 0.05],      # sum -0.05, mean -0.0167
                      [0.9, -0.1, 0.0],       # sum 0.8 (ratio 2.23), mean 0.267; token 0's ratio 2.46
                      [0.001, -0.0005, 0.0002]])  # sum 0.0007, mean 0.00023
REJ_MU = np.full((3, 3), -2.0, np.float32)
REJ_OLD = (REJ_MU + REJ_LOG_R).astype(np.float32)
ONES = np.ones((3, 3), np.float32)


@pytest.mark.parametrize(("level", "bounds", "kept", "rejected_seqs"), [
    ("token", {}, [[1, 1, 1], [0, 1, 1], [1, 1, 1]], 0),                       # e^0.9 > 2
    ("sequence", {}, [[1, 1, 1], [0, 0, 0], [1, 1, 1]], 1),                    # e^0.8 > 2
    ("geometric", {}, [[0, 0, 0], [0, 0, 0], [1, 1, 1]], 2),                   # default [1/1.001, 1.001]
    ("geometric", {"rejection_low": 0.9, "rejection_high": 1.1}, [[1, 1, 1], [0, 0, 0], [1, 1, 1]], 1),
    ("token", {"rejection_low": 0.85, "rejection_high": 1.5}, [[1, 0, 1], [0, 1, 1], [1, 1, 1]], 0),  # e^-0.2 < .85
])
def test_rejection_at_each_level_by_hand(level, bounds, kept, rejected_seqs):
    w, m = _correct(REJ_OLD, REJ_MU, ONES, is_level="none", rejection=level, **bounds)
    np.testing.assert_array_equal(w, np.asarray(kept, np.float32))  # no reweighting: 0 or 1
    assert m["is/masked_frac"] == pytest.approx(1 - np.mean(kept))
    assert m["is/rejected_seq_frac"] == pytest.approx(rejected_seqs / 3)
    assert "is/ess" not in m and "is/truncated_frac" not in m


def test_rejection_combines_with_truncated_weights():
    """Seq-TIS with geometric rejection (verl's geo_rs_seq_tis): the kept sequence keeps its truncated weight."""
    w, m = _correct(REJ_OLD, REJ_MU, ONES, is_level="sequence", is_cap=2.0, rejection="geometric")
    np.testing.assert_allclose(w[2], [math.exp(0.0007)] * 3, rtol=1e-6)
    np.testing.assert_array_equal(w[:2], 0.0)
    assert m["is/rejected_seq_frac"] == pytest.approx(2 / 3)
    assert m["is/ratio_max"] == pytest.approx(math.exp(0.8), rel=1e-6)  # the IS level's ratio (sequence)


def test_settings_checks_name_the_key():
    for bad, message in [(dict(is_mode="mask", is_level="none"), "learner.is_mode=mask needs"),
                         (dict(is_mode="mask", is_low=2.0), "learner.is_low must be in [0, learner.is_cap=2.0)"),
                         (dict(is_cap=0.0), "learner.is_cap must be > 0"),
                         (dict(rejection="token", rejection_low=3.0), "learner.rejection_low (3.0) must be >= 0"),
                         (dict(is_level="tok"), "unknown importance-sampling level 'tok'")]:
        with pytest.raises(ValueError) as e:
            RolloutCorrection(**bad)
        assert message in str(e.value), (bad, str(e.value))
    assert RolloutCorrection(is_mode="mask", is_cap=4.0).mask_bounds == (0.25, 4.0)  # low: 1 / cap
    assert RolloutCorrection(rejection="geometric").rejection_bounds == (1 / 1.001, 1.001)
    assert RolloutCorrection(rejection="sequence").rejection_bounds == (0.5, 2.0)
    assert not RolloutCorrection(is_level="none").active
    assert RolloutCorrection(is_level="none", rejection="token").active


def test_config_keys_are_the_learners():
    from posttrain.config import ConfigError, load_config
    from posttrain.rl.config import RLConfig

    cfg = load_config(RLConfig, None, ["learner.is_mode=mask", "learner.is_low=0.5", "learner.rejection=geometric",
                                       "rollout.compute_dtype=bfloat16"])
    assert cfg.learner.settings() == RolloutCorrection(is_mode="mask", is_low=0.5, rejection="geometric")
    assert cfg.rollout.compute_dtype == "bfloat16"
    for override, message in [("learner.rejection=seq", "learner.rejection': invalid value 'seq'"),
                              ("learner.is_mode=mask learner.is_level=none", "learner.is_mode=mask needs"),
                              ("rollout.compute_dtype=float64", "rollout.compute_dtype'")]:
        with pytest.raises(ConfigError) as e:
            load_config(RLConfig, None, override.split())
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------------- through the RL loss
def _rl_batch():
    from posttrain.rl.batch import build_rl_batch
    from posttrain.rollout.rollouts import Rollouts

    rng = np.random.default_rng(0)
    comps = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18]]
    ro = Rollouts(group_size=2, record_index=[0, 0, 1, 1], prompt_ids=[[3, 4], [3, 4], [20, 21, 22], [20, 21, 22]],
                  completion_ids=comps, logprobs=[(-rng.uniform(1, 3, len(c))).tolist() for c in comps],
                  finish_reasons=["stop"] * 4, texts=[""] * 4, prompts_text=[""] * 4,
                  rewards=np.zeros(4, np.float32), per_reward={}, reward_stats={})
    b = build_rl_batch(ro, np.array([1.0, -1.0, 0.5, -0.5], np.float32), multiple=8)
    log_r = np.zeros(b.loss_mask.shape, np.float32)
    log_r[0, :5] = np.log([3.0, 1.0, 0.1, 1.0, 5.0])  # slime#657's row
    log_r[2, :3] = np.log(5.0)  # a sequence that loses every token
    return b.replace(old_logp=(b.behaviour_logp + log_r) * b.loss_mask)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.slow
def test_rl_loss_weight_counts_what_the_loss_counts_padded_and_packed(aggregation):
    """The learner's batch with the weights of token-MIS: the micro-batch weight (what the trainer normalises the
    summed losses by) is the kept tokens for token-mean (8, not 14), the sequences left otherwise (3, not 4); the
    same batch packed into rows gives the same loss and weight."""
    from posttrain.models import init_model
    from posttrain.models.config import llama_like
    from posttrain.rl.loss import rl_loss
    from posttrain.rl.packing import pack_rl_batch

    model = init_model(llama_like(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                  num_kv_heads=1))
    b = _rl_batch()
    w, _ = rollout_correction(b.old_logp, b.behaviour_logp, b.loss_mask, RolloutCorrection(is_mode="mask"))
    b = b.replace(is_weight=np.asarray(w))
    kw = {"aggregation": aggregation, "max_tokens": 8}
    loss_sum, weight, _ = jax.jit(lambda bb: rl_loss(model, bb, loss_kwargs=kw))(b)
    assert float(weight) == (8.0 if aggregation == "token_mean" else 3.0)
    packed, _ = pack_rl_batch(b)
    assert packed.is_weight is not None
    loss_p, weight_p, _ = jax.jit(lambda bb: rl_loss(model, bb, loss_kwargs=kw))(packed)
    assert float(weight_p) == float(weight)
    assert float(loss_p / weight_p) == pytest.approx(float(loss_sum / weight), rel=1e-5, abs=1e-7)
