"""The trainer protocol for DPO and distillation: frozen models as step arguments, whole examples per micro-batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.algorithms.sft import token_logprobs
from posttrain.models.config import llama_like
from posttrain.models.transformer import init_model
from posttrain.training.config import OptimConfig
from posttrain.training.optim import make_optimizer
from posttrain.training.trainer import Trainer, uses_frozen

CFG = llama_like(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def _tx():
    return make_optimizer(OptimConfig(name="sgd", lr=0.1, momentum=0.0, decay="constant", clip_norm=0.0), 10)[0]


def _pairs(n_pairs=4, t=12, seed=0):
    rng = np.random.default_rng(seed)
    b = 2 * n_pairs
    ids = rng.integers(3, CFG.vocab_size, size=(b, t)).astype(np.int32)
    mask = np.zeros((b, t), np.float32)
    for r in range(b):
        mask[r, rng.integers(2, t - 2):] = 1.0  # responses of different lengths
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": np.ones((b, t), np.int32)}


def _seq_logps(model, batch):
    lp = token_logprobs(model, batch["input_ids"], attention_mask=batch["attention_mask"])
    return jnp.sum(lp * batch["loss_mask"][:, 1:], axis=-1)


def _pair_loss(model, batch, frozen):
    """-log σ(Δ_chosen - Δ_rejected) per pair (rows 2i, 2i+1), Δ = policy - reference sequence log-prob: a
    loss that is wrong unless both rows of a pair are in the same micro-batch."""
    d = _seq_logps(model, batch) - _seq_logps(frozen["reference"], batch)
    d = d.reshape(-1, 2)
    losses = -jax.nn.log_sigmoid(d[:, 0] - d[:, 1] + 0.3)
    return jnp.sum(losses), jnp.asarray(losses.shape[0], jnp.float32), {"pairs": jnp.asarray(losses.shape[0], jnp.float32)}


def _trainer(grad_accum=1, seed=0, ref_seed=1):
    return Trainer(init_model(CFG, seed=seed), _tx(), grad_accum=grad_accum, donate=False,
                   frozen={"reference": init_model(CFG, seed=ref_seed)})


@pytest.mark.slow
def test_frozen_reference_is_a_step_argument_without_optimizer_state():
    tr = _trainer()
    batch = _pairs()
    loss = uses_frozen(_pair_loss, "reference", rows_per_example=2)
    ref_before = jax.tree.map(np.asarray, tr.frozen_states["reference"])
    # the frozen weights are arguments of the compiled step, not constants baked into it
    fn = tr._build_step(loss, 2)
    args = (tr.params, tr.opt_state, tr.rest, tr._frozen_args(loss), tr.put_batch(batch), jnp.int32(0))
    closed = jax.make_jaxpr(fn)(*args)
    emb = CFG.vocab_size * CFG.hidden_size
    assert not [c for c in closed.consts if np.size(c) >= emb], "frozen weights were closed over as constants"
    n_in = len(jax.tree.leaves(args))
    assert len(closed.jaxpr.invars) == n_in
    # hand-computed loss and gradient (plain autodiff over the same formula)
    policy, ref = tr.model(), nnx.merge(tr.frozen_graphdefs["reference"], tr.frozen_states["reference"])
    gd, params, rest = nnx.split(policy, nnx.Param, ...)

    def f(p):
        ls, w, _ = _pair_loss(nnx.merge(gd, p, rest), {k: jnp.asarray(v) for k, v in batch.items()},
                              {"reference": ref})
        return ls / w

    want_loss, want_grad = jax.value_and_grad(f)(params)
    m = tr.step(batch, loss)
    np.testing.assert_allclose(m["loss"], float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(m["grad_norm"], float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(want_grad)))),
                               rtol=1e-4)
    assert m["pairs"] == 4
    # no optimizer state for the frozen model, and it did not move
    assert len(jax.tree.leaves(tr.opt_state)) <= len(jax.tree.leaves(tr.params)) + 2
    for a, b in zip(jax.tree.leaves(ref_before), jax.tree.leaves(tr.frozen_states["reference"])):
        np.testing.assert_array_equal(a, np.asarray(b))
    # precomputing the reference's log-probs uses the same frozen model
    lp = tr.frozen_token_logprobs("reference", batch)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(token_logprobs(ref, jnp.asarray(batch["input_ids"]),
                                                                         attention_mask=jnp.asarray(batch["attention_mask"]))),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_grad_accum_keeps_the_rows_of_an_example_together():
    batch = _pairs(n_pairs=4)
    loss = uses_frozen(_pair_loss, "reference", rows_per_example=2)
    one, four = _trainer(1), _trainer(4)
    m1, m4 = one.step(batch, loss), four.step(batch, loss)
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5)
    np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)  # summation order
    # the control: splitting rows one by one pairs rows of different examples, and the loss changes
    split = _trainer(4)
    ms = split.step(batch, loss, rows_per_example=1)
    assert abs(ms["loss"] - m1["loss"]) > 1e-3
    with pytest.raises(ValueError, match="examples is not divisible by grad_accum=4"):
        four.step(_pairs(n_pairs=2), loss)


def test_lora_base_is_the_frozen_model_base():
    from posttrain.models import lora

    model = init_model(CFG, seed=0)
    lora.attach(model, rank=4, alpha=8.0, target=r".*(q_proj|v_proj)", seed=0, init="gaussian")
    tr = Trainer(model, _tx(), donate=False)
    batch = _pairs(n_pairs=2)

    def base_minus_policy(model, b, frozen):
        d = _seq_logps(frozen["base"], b) - _seq_logps(model, b)
        return jnp.sum(d), jnp.asarray(1.0), {"base_logp": jnp.sum(_seq_logps(frozen["base"], b))}

    want = float(jnp.sum(jnp.asarray(tr.token_logprobs(batch, adapters=False)) * batch["loss_mask"][:, 1:]))
    ls, w, m = tr.eval_sums(batch, uses_frozen(base_minus_policy, "base"))
    np.testing.assert_allclose(m["base_logp"], want, rtol=1e-5)
    with pytest.raises(ValueError, match="frozen model 'teacher'"):
        tr.step(batch, uses_frozen(base_minus_policy, "teacher"))
