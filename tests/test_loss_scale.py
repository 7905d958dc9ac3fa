"""Loss scaling for float16 training (issue 51): an overflowing step is skipped and the scale halves, it grows back
after `period` finite steps, the scale is checkpointed and restored on resume, the trainer's settings come from
`trainer.loss_scale`, and in float16 a small loss's gradient that flushes to zero unscaled is the float32 one
scaled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.models import init_model
from posttrain.models.config import llama_like
from posttrain.training.checkpoint import Checkpointer
from posttrain.training.config import OptimConfig
from posttrain.training.loss_scale import INITIAL_SCALE, LossScale, loss_scale_for
from posttrain.training.optim import make_optimizer
from posttrain.training.trainer import Trainer

CFG = llama_like(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
IDS = np.array([[3, 5, 7, 9], [4, 6, 8, 10]], np.int32)


def scaled_logits_loss(model, batch):
    """k * sum(logits) (k = batch["k"][0]), one unit of weight: a loss whose gradient is as large as k says."""
    return batch["k"][0] * jnp.sum(model(batch["input_ids"])), jnp.asarray(1.0), {}


def _trainer(loss_scale, compute_dtype="float32", grad_accum=1, lr=1e-3):
    tx = make_optimizer(OptimConfig(name="sgd", lr=lr, momentum=0.0, decay="constant", clip_norm=0.0), 100)[0]
    return Trainer(init_model(CFG.replace(compute_dtype=compute_dtype), seed=0), tx, loss_fn=scaled_logits_loss,
                   grad_accum=grad_accum, loss_scale=loss_scale, donate=False)


def _batch(k):
    return {"input_ids": IDS, "k": np.full((2,), k, np.float32)}


def _params(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


def test_an_overflow_is_skipped_the_scale_halves_and_grows_back(tmp_path):
    trainer = _trainer(LossScale.start(2.0 ** 10, period=2))
    before = _params(trainer)
    m = trainer.step(_batch(1e36))  # 1e36 x 2^10 x the logits' gradient: beyond float32
    assert (m["skipped"], m["loss_scale/overflow"], m["loss_scale/overflows"], m["loss_scale"]) == (1.0, 1.0, 1.0,
                                                                                                      1024.0)
    assert not np.isfinite(m["grad_norm"]) and np.isfinite(m["loss"])  # the loss itself is fine: not a divergence
    for a, b in zip(before, _params(trainer)):
        np.testing.assert_array_equal(a, b)  # nothing applied
    assert float(trainer.loss_scale.scale) == 512.0
    scales = []
    for _ in range(3):
        m = trainer.step(_batch(1.0))
        scales.append(m["loss_scale"])
        assert m["skipped"] == 0.0 and m["loss_scale/overflow"] == 0.0
    assert scales == [512.0, 512.0, 1024.0]  # doubled after period=2 finite steps
    assert float(trainer.loss_scale.scale) == 1024.0 and int(trainer.loss_scale.good_steps) == 1
    assert m["loss_scale/overflows"] == 1.0
    # the scale (and its counters) go into the checkpoint and come back on resume
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(trainer)
    ckpt.close()
    resumed = _trainer(LossScale.start(2.0 ** 10, period=2))
    meta = Checkpointer(tmp_path / "ckpt", async_save=False).restore_latest(resumed)
    assert meta is not None and resumed.step_count == 4
    got = resumed.loss_scale
    assert (float(got.scale), int(got.good_steps), int(got.overflows)) == (1024.0, 1, 1)
    assert resumed.step(_batch(1.0))["loss_scale"] == 1024.0
    assert float(resumed.loss_scale.scale) == 2048.0  # the restored count of finite steps carried on


def test_a_fixed_scale_skips_overflows_and_stays():
    trainer = _trainer(LossScale.start(8.0, dynamic=False))
    assert trainer.step(_batch(1e37))["skipped"] == 1.0
    m = trainer.step(_batch(1.0))
    assert m["loss_scale"] == 8.0 and m["loss_scale/overflows"] == 1.0 and float(trainer.loss_scale.scale) == 8.0


@pytest.mark.slow
def test_scaling_by_a_power_of_two_leaves_the_update_unchanged_in_float32():
    """In float32 nothing underflows: the scaled, unscaled update equals the plain one (grad accumulation too)."""
    plain, scaled = _trainer(None, grad_accum=2), _trainer(LossScale.start(), grad_accum=2)
    for t in (plain, scaled):
        t.step(_batch(0.5))
    for a, b in zip(_params(plain), _params(scaled)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_float16_small_gradients_flush_to_zero_unscaled_and_match_float32_scaled():
    """A loss of 1e-8 x sum(logits) computed in float16: its activation gradients underflow float16 without scaling
    (most weights' gradients are zero), and with the dynamic scale they are the float32 model's within float16
    rounding."""
    k, lr = 1e-8, 1e5  # sgd's update lr * g: ~1e-3, well above the parameters' float32 rounding

    def grads(loss_scale, dtype):
        trainer = _trainer(loss_scale, dtype, lr=lr)
        before = _params(trainer)
        trainer.step(_batch(k))
        return [(a.astype(np.float64) - b) / lr for a, b in zip(before, _params(trainer))]

    ref, flushed, scaled = grads(None, "float32"), grads(None, "float16"), grads(LossScale.start(), "float16")
    rel = lambda gs: [float(np.linalg.norm(g - r) / np.linalg.norm(r)) for g, r in zip(gs, ref)]  # noqa: E731
    assert min(np.linalg.norm(r) for r in ref) > 0
    # each weight's gradient: lost to float16's underflow below the LM head unscaled, float16 rounding only scaled
    assert np.median(rel(flushed)) > 0.9, rel(flushed)  # measured: 0.76-1.0 (1.0: all flushed to zero)
    assert max(rel(scaled)) < 5e-3, rel(scaled)  # measured: 0.8e-3 - 2.1e-3


def test_trainer_loss_scale_setting():
    assert loss_scale_for("auto", "float32") is None and loss_scale_for("auto", "bfloat16") is None
    dynamic = loss_scale_for("auto", "float16")
    assert dynamic.dynamic and float(dynamic.scale) == INITIAL_SCALE
    assert loss_scale_for("none", "float16") is None
    fixed = loss_scale_for(128.0, "float32")
    assert not fixed.dynamic and float(fixed.scale) == 128.0
    from posttrain.config import ConfigError, load_config
    from posttrain.training.config import SFTConfig

    assert load_config(SFTConfig, None, ["trainer.loss_scale=256"]).trainer.loss_scale == 256.0
    assert load_config(SFTConfig, None, ["trainer.loss_scale=dynamic"]).trainer.loss_scale == "dynamic"
    for bad in ("trainer.loss_scale=big", "trainer.loss_scale=-1"):
        with pytest.raises(ConfigError, match="trainer.loss_scale"):
            load_config(SFTConfig, None, [bad])


def test_no_loss_scale_keeps_the_checkpoint_as_it_was():
    trainer = _trainer(None)
    assert "loss_scale" not in trainer.state_dict() and "loss_scale" not in trainer.step(_batch(1.0))
    assert jax.tree.leaves(nnx.state(trainer.model(), nnx.Param))
