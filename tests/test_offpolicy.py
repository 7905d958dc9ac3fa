"""The off-policy numbers of RL (issues 26, 51): importance weights from the proximal policy (not the current one),
old log-probs recomputed whenever a rollout correction is on, and, end to end on the fleet at staleness 1, stale
groups trained against recomputed old log-probs with their sampler mismatch reported."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fleet import toy  # noqa: F401 - the toy task fixture for RL runs (reward: letters 'a')

from posttrain.algorithms.correction import RolloutCorrection, rollout_correction
from posttrain.algorithms.policy import policy_loss
from posttrain.models.config import llama_like
from posttrain.models.transformer import init_model
from posttrain.rl.batch import build_rl_batch
from posttrain.rl.learner import Learner
from posttrain.rl.loop import load_rl_config, run_rl
from posttrain.rl.loss import make_rl_loss
from posttrain.rollout.rollouts import Rollouts
from posttrain.training.config import OptimConfig
from posttrain.training.optim import make_optimizer
from posttrain.training.trainer import Trainer

CFG = llama_like(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
LOSS = {"epsilon_low": 0.2, "epsilon_high": 0.2}


# ---------------------------------------------------------------------- importance weights: pi_old / mu
# three different policies: current pi (logp), proximal pi_old (old), behaviour mu (the sampler's)
LOGP = np.array([[-1.0, -2.0, -0.3], [-0.5, -0.9, -1.1]], np.float32)
OLD = np.array([[-1.2, -1.5, -0.3], [-0.6, -0.4, -1.0]], np.float32)
MU = np.array([[-1.0, -1.9, -0.1], [-0.9, -0.5, -7.0]], np.float32)
ADV = np.array([1.5, -2.0], np.float32)
MASK = np.array([[1, 1, 0], [1, 1, 1]], np.float32)  # row 0's third token is padding


def _hand_surrogate(eps=0.2):
    """-min(r A, clip(r, 1-eps, 1+eps) A) per token, r = pi / pi_old (numpy, no weights)."""
    r = np.exp(LOGP - OLD)
    a = ADV[:, None]
    return -np.minimum(r * a, np.clip(r, 1 - eps, 1 + eps) * a)


@pytest.mark.slow
def test_token_is_weights_are_pi_old_over_mu_not_pi_over_mu():
    cap = 1.3
    rho = np.exp(OLD - MU)  # pi_old / mu
    w = np.minimum(rho, cap)
    expected = np.sum(_hand_surrogate() * w * MASK) / MASK.sum()  # token mean
    weights, m = rollout_correction(OLD, MU, MASK, RolloutCorrection(is_level="token", is_cap=cap))
    loss, _ = policy_loss(jnp.asarray(LOGP), jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK), is_weights=weights)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(m["is/weight_mean"]), np.sum(w * MASK) / MASK.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(m["is/truncated_frac"]), np.sum((rho > cap) * MASK) / MASK.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(m["mismatch_kl"]), np.sum((rho - 1 - np.log(rho)) * MASK) / MASK.sum(),
                               rtol=1e-5)
    # weights are constants: the gradient is the surrogate's, scaled per token (clipped tokens: none)
    r = np.exp(LOGP - OLD)
    a = np.broadcast_to(ADV[:, None], r.shape)
    live = ~(((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8)))
    grad = jax.grad(lambda lp: policy_loss(lp, jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK),
                                           is_weights=weights)[0])(jnp.asarray(LOGP))
    np.testing.assert_allclose(np.asarray(grad), -a * r * w * live * MASK / MASK.sum(), rtol=1e-5, atol=1e-7)


def test_sequence_is_weights_are_pi_old_over_mu_not_pi_over_mu():
    cap = 2.0
    rho = np.minimum(np.exp(np.sum((OLD - MU) * MASK, axis=1)), cap)  # [exp(0.2), cut at 2]
    expected = np.sum(_hand_surrogate() * rho[:, None] * MASK) / MASK.sum()
    weights, m = rollout_correction(OLD, MU, MASK, RolloutCorrection(is_level="sequence", is_cap=cap))
    loss, _ = policy_loss(jnp.asarray(LOGP), jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK), is_weights=weights)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(m["is/weight_mean"]), np.sum(rho[:, None] * MASK) / MASK.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(m["is/truncated_frac"]), 0.5)  # of the sequences


# ---------------------------------------------------------------------- the learner's old log-probs
def _batch(trainer, seed=0):
    """A prepared RL batch (4 completions of different lengths) whose sampler log-probs (behaviour, and the old
    log-probs until recomputed) are those of a policy near, but not equal to, the trainer's."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in (5, 3, 7, 4)]
    comps = [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in (6, 2, 9, 4)]
    ro = Rollouts(group_size=2, record_index=[0, 0, 1, 1], prompt_ids=prompts, completion_ids=comps,
                  logprobs=[[0.0] * len(c) for c in comps], finish_reasons=["stop"] * 4, texts=[""] * 4,
                  prompts_text=[""] * 4, rewards=np.array([1.0, 0.0, 0.5, 0.0], np.float32), per_reward={},
                  reward_stats={})
    batch = build_rl_batch(ro, np.array([0.8, -0.8, 1.0, -1.0], np.float32), multiple=8)
    now = np.asarray(trainer.token_logprobs(batch.model_inputs(), last=batch.completion_len))
    mu = ((now + rng.uniform(-0.4, 0.4, size=now.shape)) * batch.loss_mask).astype(np.float32)
    return batch.replace(behaviour_logp=mu)


def _learner(*, recompute_old=False, correction=RolloutCorrection()):
    tx = make_optimizer(OptimConfig(name="sgd", lr=0.5, momentum=0.0, decay="constant", clip_norm=0.0), 10)[0]
    trainer = Trainer(init_model(CFG, seed=0), tx, donate=False)
    learner = Learner(trainer, make_rl_loss(LOSS), ppo_epochs=1, minibatches=1, seed=0, recompute_old=recompute_old,
                      correction=correction)
    seen = []
    step = trainer.step

    def recording_step(batch, loss_fn=None, **kw):
        seen.append({f.name: np.array(getattr(batch, f.name)) for f in dataclasses.fields(batch)
                     if getattr(batch, f.name) is not None})
        return step(batch, loss_fn, **kw)

    trainer.step = recording_step
    return learner, trainer, seen


@pytest.mark.slow
def test_old_logprobs_are_recomputed_with_a_correction_on():
    learner, trainer, seen = _learner()
    batch = _batch(trainer)
    mask, mu = batch.loss_mask, batch.behaviour_logp.copy()
    fresh = np.asarray(trainer.token_logprobs(batch.model_inputs(), last=mask.shape[1]))  # the weights being updated
    metrics = learner.update(batch, step=3)
    old = seen[0]["old_logp"]
    np.testing.assert_allclose(old * mask, fresh * mask, rtol=1e-5, atol=1e-6)
    assert np.abs((old - mu) * mask).max() > 0.1  # not the sampler's
    np.testing.assert_array_equal(seen[0]["behaviour_logp"], mu)  # the behaviour log-probs stay the sampler's
    # the step's numbers: ratio pi / pi_old is 1 at the first update; the weights and mismatch are pi_old vs mu
    rho = np.exp(fresh - mu)
    n = mask.sum()
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["mismatch_kl"] == pytest.approx(np.sum((rho - 1 - np.log(rho)) * mask) / n, rel=1e-3)
    assert metrics["is/weight_mean"] == pytest.approx(np.sum(np.minimum(rho, 2.0) * mask) / n, rel=1e-4)
    assert metrics["mismatch_kl"] > 1e-3
    np.testing.assert_allclose(seen[0]["is_weight"], np.minimum(rho, 2.0) * mask, rtol=1e-5)  # into the batch


@pytest.mark.slow
def test_old_logprobs_are_the_samplers_without_a_correction():
    """No rollout correction (is_level=none, rejection=none): the PPO ratio is taken against the sampler's own
    log-probs, nothing is recomputed and no mismatch is reported; with old_logprobs=recompute they are recomputed
    and the mismatch is reported, no weights applied."""
    learner, trainer, seen = _learner(correction=RolloutCorrection(is_level="none"))
    batch = _batch(trainer, seed=1)
    mask, mu = batch.loss_mask, batch.behaviour_logp.copy()
    fresh = np.asarray(trainer.token_logprobs(batch.model_inputs(), last=mask.shape[1]))
    metrics = learner.update(batch, step=1)
    np.testing.assert_array_equal(seen[0]["old_logp"], mu)
    assert "mismatch_kl" not in metrics and "is_weight" not in seen[0]
    assert metrics["ratio_mean"] == pytest.approx(np.sum(np.exp(fresh - mu) * mask) / mask.sum(), rel=1e-4)
    # old_logprobs=recompute: recomputed even so
    learner, trainer, seen = _learner(recompute_old=True, correction=None)
    metrics = learner.update(_batch(trainer, seed=1), step=1)
    np.testing.assert_allclose(seen[0]["old_logp"] * mask, fresh * mask, rtol=1e-5, atol=1e-6)
    assert metrics["mismatch_kl"] > 1e-3 and "is_weight" not in seen[0]


# ---------------------------------------------------------------------- end to end: the fleet at staleness 1
@pytest.mark.slow
def test_fleet_trains_one_version_stale_groups_against_recomputed_old_logprobs(toy):  # noqa: F811
    """One worker, `max_staleness=1`, weights published every 2 steps: step 2 trains groups sampled with
    version 0 while the trainer holds version 1 (staleness 1 by construction, not by timing). Its old
    log-probs are recomputed (ratio pi / pi_old exactly 1 at the single update) and differ from the sampler's
    (a nonzero `mismatch_kl`); step 1, on-policy, recomputes them too (the correction is on) and finds the two
    implementations' float32 rounding only."""
    from test_fleet import ledger, metric_rows

    res = run_rl(load_rl_config(None, toy("stale", "trainer.max_steps=2", "fleet.workers=1", "fleet.max_staleness=1",
                                          "fleet.publish_every=2", "optim.lr=3e-2",
                                          # step 1 moves the weights whatever it samples ('a' can be missing)
                                          f"rewards.functions=[{{name: '{toy.dir / 'reward.py'}:distinct'}}]")))
    assert res.steps == 2
    assert [r["staleness_max"] for r in ledger(toy.dir / "stale")] == [0, 1]
    rows = metric_rows(toy.dir / "stale")
    print({s: {k: rows[s][k] for k in ("ratio_mean", "mismatch_kl", "is/weight_mean")} for s in rows})
    assert rows[2]["fleet/staleness_max"] == 1 and rows[2]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert rows[2]["mismatch_kl"] > 1e-5 > rows[1]["mismatch_kl"]
    assert rows[2]["is/weight_mean"] != pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
def test_reference_logprobs_are_the_frozen_models_at_the_completion_tokens():
    """beta > 0: the reference log-probs (`FrozenScorer`, vocabulary projected at the completion columns only)
    are the frozen model's for the completion tokens: the step's KL is k3 against an independent pass, and 0
    when the reference is the policy's own initial weights."""
    from posttrain.algorithms.kl import kl_penalty
    from posttrain.algorithms.sft import token_logprobs
    from posttrain.rl.learner import FrozenScorer

    for ref_seed in (1, 0):
        learner, trainer, seen = _learner()
        reference = init_model(CFG, seed=ref_seed)
        learner.ref_fn = FrozenScorer(reference, trainer)
        learner.loss_fn = make_rl_loss({**LOSS, "beta": 0.1, "kl_estimator": "k3"})
        batch = _batch(trainer, seed=2)
        mask = batch.loss_mask
        c = mask.shape[1]
        pi = np.asarray(trainer.token_logprobs(batch.model_inputs(), last=c))
        ref = np.asarray(token_logprobs(reference, batch.input_ids, attention_mask=batch.attention_mask,
                                        positions=batch.positions))[:, -c:]
        metrics = learner.update(batch, step=1)
        np.testing.assert_allclose(seen[0]["ref_logp"] * mask, ref * mask, rtol=1e-5, atol=1e-5)
        expected = np.sum(np.asarray(kl_penalty(pi, ref, "k3")) * mask) / mask.sum()
        assert metrics["kl"] == pytest.approx(expected, rel=1e-3, abs=1e-7)
        assert (metrics["kl"] > 1e-3) if ref_seed else (metrics["kl"] < 1e-6)
