"""Hand-computed checks of KL estimators, loss aggregation, the clipped policy loss (token
level and GSPO sequence level, including gradients), entropy, and the algorithm registry."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.algorithms import registry
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.policy import aggregate, entropy_from_logits, policy_loss

pytestmark = pytest.mark.full_optimization  # numbers against a reference: compiled as users' runs are (tests/conftest.py)

# ----------------------------------------------------------------------------- KL estimators


def test_kl_estimators():
    logp = jnp.array([-1.0, -2.0, -3.0])
    ref = jnp.array([-2.0, -1.0, -3.0])
    # logp - ref = [1, -1, 0]
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1"), [1.0, -1.0, 0.0])
    # 0.5 * d^2 = [0.5, 0.5, 0]
    np.testing.assert_allclose(kl_penalty(logp, ref, "k2"), [0.5, 0.5, 0.0])
    # ref - logp = [-1, 1, 0]: exp(-1)+1-1 = 0.367879, exp(1)-1-1 = 0.718282, 1-0-1 = 0
    np.testing.assert_allclose(kl_penalty(logp, ref, "k3"), [math.exp(-1), math.e - 2, 0.0], rtol=1e-6)
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, ref, "k4")


# ----------------------------------------------------------------------------- aggregation

X = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [9.0, 9.0, 9.0]])
M = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=jnp.float32)  # row 3 fully masked


def test_aggregate_token_mean():
    # (1 + 2 + 4) / 3 tokens = 7/3
    np.testing.assert_allclose(aggregate(X, M, "token_mean"), 7 / 3, rtol=1e-6)
    np.testing.assert_allclose(aggregate(X, M.astype(bool), "token_mean"), 7 / 3, rtol=1e-6)


def test_aggregate_seq_mean_token_mean():
    # seq 1: (1+2)/2 = 1.5; seq 2: 4/1 = 4; seq 3 has no tokens and is skipped -> (1.5+4)/2
    np.testing.assert_allclose(aggregate(X, M, "seq_mean_token_mean"), 2.75, rtol=1e-6)


def test_aggregate_seq_mean_token_sum_norm():
    # sum(x*m) = 7; N = 3 rows; default max_tokens = T = 3 -> 7/9
    np.testing.assert_allclose(aggregate(X, M, "seq_mean_token_sum_norm"), 7 / 9, rtol=1e-6)
    # constant budget 7: 7 / (3*7) = 1/3
    np.testing.assert_allclose(aggregate(X, M, "seq_mean_token_sum_norm", max_tokens=7), 1 / 3, rtol=1e-6)


def test_aggregate_empty_mask_is_zero_not_nan():
    z = jnp.zeros_like(M)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        assert float(aggregate(X, z, mode)) == 0.0
    with pytest.raises(ValueError, match="token_sum"):
        aggregate(X, M, "token_sum")



def test_aggregation_weights_make_micro_batch_sums_exact():
    """Each mode's weight w (the trainer's normaliser) makes Σ L_k w_k / Σ w_k over micro-batches equal the
    aggregate over the whole batch; the config strings are the enum's values."""
    from posttrain.algorithms.policy import Aggregation

    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 5)), jnp.float32)
    m = jnp.asarray([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0] * 5, [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1] * 4 + [0]],
                    jnp.float32)
    assert {a.value for a in Aggregation} == set(registry.AGGREGATIONS)
    for mode in Aggregation:
        whole = float(mode.reduce(x, m, max_tokens=8))
        halves = (np.array([0, 2, 4]), np.array([1, 3, 5]))
        parts = [(mode.reduce(x[k], m[k], max_tokens=8), mode.weight(m[k])) for k in halves]
        summed = float(sum(loss * w for loss, w in parts) / sum(w for _, w in parts))
        np.testing.assert_allclose(summed, whole, rtol=1e-5, err_msg=mode)
        assert float(aggregate(x, m, str(mode), max_tokens=8)) == whole
    with pytest.raises(ValueError, match=r"unknown aggregation mode 'token_sum'; accepted: \['seq_mean_token_mean'"):
        Aggregation.of("token_sum")

# ----------------------------------------------------------------------------- token-level loss
# eps_low = 0.2, eps_high = 0.28 -> clip range [0.8, 1.28]
# seq 0, A = +1, ratios [1.5, 0.5, 1.0, (masked)]
#   1.5: min(1.5, 1.28) = 1.28 -> loss -1.28   (high clip)
#   0.5: min(0.5, 0.8) = 0.5   -> loss -0.5    (no clip: A > 0)
#   1.0:                          loss -1.0
# seq 1, A = -2, ratios [0.5, 1.5, 1.1, 1.0]
#   0.5: min(-1.0, 0.8*-2=-1.6) = -1.6  -> loss 1.6  (low clip)
#   1.5: min(-3.0, 1.28*-2=-2.56) = -3  -> loss 3.0  (no clip: A < 0)
#   1.1: -2.2 both                       -> loss 2.2
#   1.0:                                   loss 2.0
RATIOS = np.array([[1.5, 0.5, 1.0, 1.0], [0.5, 1.5, 1.1, 1.0]])
MASK = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=jnp.float32)
ADV = jnp.array([1.0, -2.0])
OLD = jnp.array([[-1.0, -2.0, -0.5, -3.0], [-0.7, -1.2, -2.0, -0.1]])
LOGP = OLD + jnp.log(jnp.asarray(RATIOS))
LOGP = LOGP.at[0, 3].set(60.0)  # garbage on a masked position must not leak (exp(61) overflows)
SEQ0 = [-1.28, -0.5, -1.0]
SEQ1 = [1.6, 3.0, 2.2, 2.0]


def test_policy_loss_token_level_token_mean():
    loss, m = policy_loss(LOGP, OLD, ADV, MASK, epsilon_low=0.2, epsilon_high=0.28)
    # (−1.28 − 0.5 − 1.0 + 1.6 + 3.0 + 2.2 + 2.0) / 7 = 6.02 / 7
    np.testing.assert_allclose(loss, 6.02 / 7, rtol=1e-5)
    np.testing.assert_allclose(m["pg_loss"], 6.02 / 7, rtol=1e-5)
    np.testing.assert_allclose(m["clip_frac_high"], 1 / 7, rtol=1e-6)  # the 1.5 with A > 0
    np.testing.assert_allclose(m["clip_frac_low"], 1 / 7, rtol=1e-6)  # the 0.5 with A < 0
    np.testing.assert_allclose(m["clip_fraction"], 2 / 7, rtol=1e-6)
    # ratio mean over 7 masked tokens: (1.5+0.5+1.0 + 0.5+1.5+1.1+1.0)/7 = (3.0 + 4.1)/7 = 7.1/7
    np.testing.assert_allclose(m["ratio_mean"], 7.1 / 7, rtol=1e-5)
    assert "kl" not in m


def test_policy_loss_token_level_other_aggregations():
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, epsilon_low=0.2, epsilon_high=0.28, aggregation="seq_mean_token_mean")
    # seq 0 mean: -2.78/3 = -0.926667; seq 1 mean: 8.8/4 = 2.2; mean = 0.636667
    np.testing.assert_allclose(loss, (sum(SEQ0) / 3 + sum(SEQ1) / 4) / 2, rtol=1e-5)
    loss, _ = policy_loss(
        LOGP, OLD, ADV, MASK, epsilon_low=0.2, epsilon_high=0.28, aggregation="seq_mean_token_sum_norm", max_tokens=10
    )
    # 6.02 / (N=2 * 10)
    np.testing.assert_allclose(loss, 6.02 / 20, rtol=1e-5)


def test_policy_loss_symmetric_clip_changes_high_branch():
    # eps_high = 0.2: the A>0, r=1.5 token now gives -1.2 instead of -1.28 (and r=1.5, A<0 is
    # still unclipped) -> total 6.02 + 0.08 = 6.10
    loss, m = policy_loss(LOGP, OLD, ADV, MASK, epsilon_low=0.2, epsilon_high=0.2)
    np.testing.assert_allclose(loss, 6.10 / 7, rtol=1e-5)


@pytest.mark.slow
def test_policy_loss_gradient_matches_hand_value():
    def f(lp):
        return policy_loss(lp, OLD, ADV, MASK, epsilon_low=0.2, epsilon_high=0.28)[0]

    g = np.asarray(jax.grad(f)(LOGP))
    # d/dlogp_t of -(r_t * A)/7 = -r_t * A / 7 on unclipped tokens; 0 on clipped / masked ones
    expected = np.array(
        [
            [0.0, -0.5 * 1 / 7, -1.0 * 1 / 7, 0.0],
            [0.0, 1.5 * 2 / 7, 1.1 * 2 / 7, 1.0 * 2 / 7],
        ]
    )
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)
    assert np.all(np.isfinite(g))


def test_policy_loss_kl_term():
    ref = LOGP - 0.5  # logp - ref = 0.5 on every token
    loss, m = policy_loss(LOGP, OLD, ADV, MASK, epsilon_low=0.2, epsilon_high=0.28, ref_logp=ref, beta=0.1, kl_estimator="k1")
    # k1 = 0.5 per token; token mean of (l_t + 0.1*0.5) = 6.02/7 + 0.05
    np.testing.assert_allclose(loss, 6.02 / 7 + 0.05, rtol=1e-5)
    np.testing.assert_allclose(m["kl"], 0.5, rtol=1e-5)
    # k3 with ref - logp = -0.5: exp(-0.5) + 0.5 - 1 = 0.106531; metric only when beta = 0
    loss, m = policy_loss(LOGP, OLD, ADV, MASK, epsilon_low=0.2, epsilon_high=0.28, ref_logp=ref)
    np.testing.assert_allclose(loss, 6.02 / 7, rtol=1e-5)
    np.testing.assert_allclose(m["kl"], math.exp(-0.5) - 0.5, rtol=1e-5)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(LOGP, OLD, ADV, MASK, beta=0.1)


# ----------------------------------------------------------------------------- GSPO
# seq 0: 2 tokens, log ratios [0.1, 0.3] -> mean 0.2 -> s0 = e^0.2 = 1.221403, A = +1
# seq 1: 3 tokens, log ratios [-0.1, -0.2, -0.3] -> mean -0.2 -> s1 = e^-0.2 = 0.818731, A = -1
G_OLD = jnp.array([[-1.0, -2.0, -1.5], [-0.5, -1.0, -2.0]])
G_LOGP = G_OLD + jnp.array([[0.1, 0.3, 7.0], [-0.1, -0.2, -0.3]])  # 7.0 is masked out
G_MASK = jnp.array([[1, 1, 0], [1, 1, 1]], dtype=jnp.float32)
G_ADV = jnp.array([1.0, -1.0])
S0, S1 = math.exp(0.2), math.exp(-0.2)


@pytest.mark.slow
def test_gspo_sequence_ratio_clipped():
    loss, m = policy_loss(
        G_LOGP, G_OLD, G_ADV, G_MASK, epsilon_low=0.1, epsilon_high=0.15,
        ratio_level="sequence", aggregation="seq_mean_token_mean",
    )
    # clip range [0.9, 1.15]; s0 = 1.2214 > 1.15 with A>0 -> -1.15;
    # s1 = 0.8187 < 0.9 with A<0 -> -min(-0.8187, -0.9) = 0.9; mean over sequences -0.125
    np.testing.assert_allclose(loss, (-1.15 + 0.9) / 2, rtol=1e-5)
    np.testing.assert_allclose(m["clip_frac_high"], 0.5)
    np.testing.assert_allclose(m["clip_frac_low"], 0.5)
    np.testing.assert_allclose(m["ratio_mean"], (S0 + S1) / 2, rtol=1e-5)
    g = jax.grad(lambda lp: policy_loss(lp, G_OLD, G_ADV, G_MASK, epsilon_low=0.1, epsilon_high=0.15,
                                        ratio_level="sequence", aggregation="seq_mean_token_mean")[0])(G_LOGP)
    np.testing.assert_allclose(g, np.zeros((2, 3)), atol=1e-7)  # both sequences clipped


def test_gspo_unclipped_value_and_gradient():
    def f(lp):
        return policy_loss(lp, G_OLD, G_ADV, G_MASK, epsilon_low=0.5, epsilon_high=0.5,
                           ratio_level="sequence", aggregation="seq_mean_token_mean")

    loss, m = f(G_LOGP)
    # per-sequence loss -s_i * A_i: -1.221403 and +0.818731; mean = -0.201336
    np.testing.assert_allclose(loss, (-S0 + S1) / 2, rtol=1e-5)
    assert float(m["clip_fraction"]) == 0.0
    g = np.asarray(jax.grad(lambda lp: f(lp)[0])(G_LOGP))
    # GSPO gradient: d/dlogp_t = (1/N) * (1/|y_i|) * (-A_i * s_i)
    # seq 0: 1/2 * 1/2 * -1.221403 = -0.305351 ; seq 1: 1/2 * 1/3 * +0.818731 = 0.136455
    expected = np.array([[-S0 / 4, -S0 / 4, 0.0], [S1 / 6, S1 / 6, S1 / 6]])
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)


def test_gspo_differs_from_token_level():
    tok, _ = policy_loss(G_LOGP, G_OLD, G_ADV, G_MASK, epsilon_low=0.5, epsilon_high=0.5, aggregation="seq_mean_token_mean")
    # token level: seq 0 mean(-e^.1, -e^.3); seq 1 mean(e^-.1, e^-.2, e^-.3)
    t0 = -(math.exp(0.1) + math.exp(0.3)) / 2
    t1 = (math.exp(-0.1) + math.exp(-0.2) + math.exp(-0.3)) / 3
    np.testing.assert_allclose(tok, (t0 + t1) / 2, rtol=1e-5)
    assert abs(float(tok) - (-S0 + S1) / 2) > 1e-3


def test_policy_loss_jits():
    f = jax.jit(lambda lp, old, a, mk: policy_loss(lp, old, a, mk, epsilon_high=0.28)[0])
    np.testing.assert_allclose(f(LOGP, OLD, ADV, MASK), 6.02 / 7, rtol=1e-5)


# ----------------------------------------------------------------------------- entropy


def test_entropy_from_logits():
    logits = jnp.array([[[0.0, 0.0], [0.0, math.log(3.0)]]], dtype=jnp.bfloat16)
    # token 1: uniform over 2 -> ln 2 = 0.693147
    # token 2: p = [0.25, 0.75] -> 0.25*ln4 + 0.75*ln(4/3) = 0.346574 + 0.215762 = 0.562335
    h = entropy_from_logits(logits, jnp.array([[1.0, 1.0]]))
    assert h.dtype == jnp.float32
    np.testing.assert_allclose(h, (math.log(2) + 0.562335) / 2, rtol=2e-3)  # bf16 log(3)
    np.testing.assert_allclose(entropy_from_logits(logits, jnp.array([[1.0, 0.0]])), math.log(2), rtol=1e-5)
    assert float(entropy_from_logits(logits, jnp.zeros((1, 2)))) == 0.0


# ----------------------------------------------------------------------------- registry


def test_registry_lookup_and_errors():
    assert registry.get(registry.ADVANTAGES, "rloo") is registry.ADVANTAGES["rloo"]
    with pytest.raises(ValueError, match=r"'ppo'.*dr_grpo.*grpo.*rloo"):
        registry.get(registry.ADVANTAGES, "ppo")
    with pytest.raises(ValueError, match="k9"):
        registry.get(registry.KL_ESTIMATORS, "k9")
    assert set(registry.AGGREGATIONS) == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"}
    with pytest.raises(ValueError, match="bogus"):
        registry.get_preset("grpo", bogus=1)


def test_presets_match_papers_and_run():
    p = registry.PRESETS
    assert (p["grpo"].advantage, p["grpo"].aggregation, p["grpo"].beta) == ("grpo", "seq_mean_token_mean", 0.04)
    assert (p["dr_grpo"].advantage, p["dr_grpo"].aggregation, p["dr_grpo"].beta) == ("dr_grpo", "seq_mean_token_sum_norm", 0.0)
    assert (p["dapo"].epsilon_low, p["dapo"].epsilon_high, p["dapo"].aggregation) == (0.2, 0.28, "token_mean")
    assert p["dapo"].dynamic_sampling and p["dapo"].overlong_filtering and p["dapo"].overlong_penalty
    assert (p["gspo"].ratio_level, p["gspo"].epsilon_low, p["gspo"].epsilon_high) == ("sequence", 3e-4, 4e-4)
    assert p["rloo"].advantage == "rloo" and p["rloo"].aggregation == "token_mean"
    ref = LOGP - 0.1
    for name, preset in p.items():
        assert preset.preset == name and type(preset) is registry.PRESET_CLASSES[name]
        registry.get(registry.ADVANTAGES, preset.advantage)
        loss, _ = policy_loss(LOGP, OLD, ADV, MASK, ref_logp=ref, **registry.loss_kwargs(preset))
        assert np.isfinite(float(loss)), name


def test_presets_are_typed_with_one_source_of_defaults():
    """The config's `algorithm` section is the typed preset: `GRPOFamily(preset=NAME, **settings)` is NAME's class
    with the settings given and that class's defaults for the rest (how the config loader builds the section)."""
    assert registry.PRESETS["dapo"] == registry.DAPO() and isinstance(registry.PRESETS["dapo"], registry.GRPOFamily)
    resolved = registry.GRPOFamily(preset="gspo", beta=0.01)
    assert isinstance(resolved, registry.GSPO) and resolved.beta == 0.01 and resolved.epsilon_low == 3e-4
    assert resolved == registry.get_preset("gspo", beta=0.01)
    assert registry.PRESETS["gspo"].beta == 0.0  # the registry's instance is not changed by an override
    assert registry.GRPOFamily(preset="dapo") == registry.DAPO()  # unset settings keep the class's defaults
    assert registry.GRPOFamily() == registry.GRPO()  # no preset named: grpo
    with pytest.raises(ValueError, match=r"unknown algorithm preset 'ppo'; accepted: \['dapo'"):
        registry.GRPOFamily(preset="ppo")
    with pytest.raises(ValueError, match="algorithm.preset='grpo' for the 'dapo' preset's class"):
        registry.DAPO(preset="grpo")
    with pytest.raises(ValueError, match=r"algorithm.aggregation='seq_sum' is not known; accepted: \['seq_mean_token_mean'"):
        registry.get_preset("grpo", aggregation="seq_sum")
    with pytest.raises(ValueError, match="algorithm.epsilon_low must be >= 0"):
        registry.get_preset("grpo", epsilon_low=-0.1)


