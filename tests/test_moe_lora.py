"""LoRA on a mixture of experts (`posttrain.models.lora`): adapters on attention and on every expert weight (one pair
per expert), equal to their merge, off under `disabled`, trained by the trainer while the base stays frozen."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain.algorithms.sft import make_sft_loss
from posttrain.models import from_pretrained, lora, save_pretrained
from posttrain.models.tiny import resolve_model_path


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return resolve_model_path("tiny:qwen3_moe", cache_dir=tmp_path_factory.mktemp("tiny"))


def _batch(vocab):
    ids = np.random.default_rng(0).integers(3, vocab, size=(4, 10))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def _randomise_b(model, seed=1):
    """Non-zero B matrices (they start at zero), so that the adapters change the outputs."""
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))):
        if path[-1] == "lora_b":
            var.set_value(0.05 * jax.random.normal(jax.random.fold_in(key, i), var.get_value().shape))


@pytest.mark.slow
def test_adapters_cover_attention_and_experts_and_merge_exactly(tiny_moe, tmp_path):
    model = from_pretrained(tiny_moe)
    ids, mask = _batch(model.cfg.vocab_size)
    base = np.asarray(model(ids, attention_mask=mask))
    paths = lora.attach(model, rank=4, alpha=8.0)
    assert {"layers.moe.experts.gate_proj", "layers.moe.experts.up_proj", "layers.moe.experts.down_proj",
            "layers.self_attn.q_proj", "layers.self_attn.o_proj"} <= set(paths)
    assert "layers.moe.gate" not in paths  # the router: not in the default target
    adapter = model.layers.moe.experts.down_proj_lora
    layers, experts, f, d = model.layers.moe.experts.down_proj[...].shape
    assert adapter.lora_a[...].shape == (layers, experts, f, 4) and adapter.lora_b[...].shape == (layers, experts, 4, d)
    assert np.array_equal(np.asarray(model(ids, attention_mask=mask)), base)  # B = 0: the base model
    _randomise_b(model)
    adapted = np.asarray(model(ids, attention_mask=mask))
    assert np.abs(adapted - base).max() > 1e-3
    with lora.disabled(model):
        assert np.array_equal(np.asarray(model(ids, attention_mask=mask)), base)
    assert lora.has_lora(model)
    lora.merge(model)
    assert not lora.has_lora(model) and model.layers.moe.experts.up_proj_lora is None
    np.testing.assert_allclose(np.asarray(model(ids, attention_mask=mask)), adapted, atol=2e-5)
    out = save_pretrained(model, tmp_path / "merged")  # an ordinary checkpoint again
    np.testing.assert_allclose(np.asarray(from_pretrained(out)(ids, attention_mask=mask)), adapted, atol=2e-5)


@pytest.mark.slow
def test_expert_adapters_only_on_request_and_in_training(tiny_moe):
    """A target naming expert weights only adapts them; the trainer trains the adapters (expert ones too), the base
    weights stay as they were, and a LoRA model's base (adapters off) is the original model."""
    from posttrain.training.trainer import Trainer

    model = from_pretrained(tiny_moe)
    ids, mask = _batch(model.cfg.vocab_size)
    base_logits = np.asarray(model(ids, attention_mask=mask))
    assert lora.attach(model, rank=2, alpha=4.0, target=r".*experts\.(up|down)_proj") == [
        "layers.moe.experts.up_proj", "layers.moe.experts.down_proj"]
    with pytest.raises(ValueError, match="matches no linear module"):
        lora.attach(from_pretrained(tiny_moe), rank=2, alpha=4.0, target=r".*nothing")
    before = np.asarray(model.layers.moe.experts.up_proj[...])
    trainer = Trainer(model, optax.adam(1e-2), loss_fn=make_sft_loss())
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    for _ in range(2):
        metrics = trainer.step(batch)
    assert metrics["skipped"] == 0.0 and "moe/aux_loss" in metrics
    trained = trainer.model()
    b = np.asarray(trained.layers.moe.experts.up_proj_lora.lora_b[...])
    assert np.abs(b).max() > 0  # the expert adapters moved
    assert np.array_equal(np.asarray(trained.layers.moe.experts.up_proj[...]), before)
    assert np.array_equal(np.asarray(trainer.model(adapters=False)(ids, attention_mask=mask)), base_logits)
