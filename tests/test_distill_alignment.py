"""Logit distillation's token alignment (issue 26): which positions the loss counts and which teacher scores it
compares against. With alpha = 0 the loss is the data's cross-entropy: exactly SFT's on the same batch (same
targets, same loss mask); the teacher's stored top-k with k = V gives the full-logits loss."""

from __future__ import annotations

import numpy as np
import pytest

from posttrain.algorithms.distill import make_token_loss
from posttrain.algorithms.sft import make_sft_loss
from posttrain.distill.logit_loss import make_logit_distill_loss, teacher_topk_fn
from posttrain.models.config import llama_like
from posttrain.models.transformer import init_model

CFG = llama_like(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def _batch(seed=0, b=3, t=12):
    """SFT rows whose loss mask starts at different positions (a prompt of varying length), one with a pad tail."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, CFG.vocab_size, size=(b, t)).astype(np.int32)
    attention = np.ones((b, t), np.int32)
    loss_mask = np.zeros((b, t), np.float32)
    for r, (start, end) in enumerate([(2, t), (5, t - 3), (8, t)][:b]):
        loss_mask[r, start:end] = 1.0
    attention[1, t - 3:] = 0
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask, "positions": positions}


@pytest.fixture(scope="module")
def models():
    return init_model(CFG, seed=0), init_model(CFG, seed=1)


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.slow
def test_alpha_zero_is_the_sft_loss_of_the_same_batch(models, chunk):
    student, teacher = models
    batch = _batch()
    sft_sum, sft_n, _ = make_sft_loss(chunk)(student, batch)
    assert float(sft_n) == 10 + 4 + 4
    loss = make_logit_distill_loss(make_token_loss("forward_kl", alpha=0.0), chunk)
    got_sum, got_n, m = loss(student, batch, {"teacher": teacher})
    assert float(got_n) == float(sft_n)
    np.testing.assert_allclose(float(got_sum), float(sft_sum), rtol=1e-5)
    np.testing.assert_allclose(float(m["distill/ce"][0]), float(sft_sum), rtol=1e-5)
    # the stored top-k path counts the same tokens
    v, i = teacher_topk_fn(teacher, 5)(batch)
    topk_sum, topk_n, _ = loss(student, {**batch, "teacher_logp": np.asarray(v), "teacher_ids": np.asarray(i)})
    assert float(topk_n) == float(sft_n)
    np.testing.assert_allclose(float(topk_sum), float(sft_sum), rtol=1e-5)


def test_stored_topk_of_the_whole_vocabulary_is_the_full_teacher_loss(models):
    student, teacher = models
    batch = _batch(seed=1)
    loss = make_logit_distill_loss(make_token_loss("jsd", temperature=1.5, alpha=0.7))
    full_sum, full_n, _ = loss(student, batch, {"teacher": teacher})
    v, i = teacher_topk_fn(teacher, CFG.vocab_size, temperature=1.5)(batch)
    stored_sum, stored_n, _ = loss(student, {**batch, "teacher_logp": np.asarray(v), "teacher_ids": np.asarray(i)})
    assert float(stored_n) == float(full_n)
    np.testing.assert_allclose(float(stored_sum), float(full_sum), rtol=1e-4)


def test_a_teacher_equal_to_the_student_agrees_everywhere_and_diverges_nowhere(models):
    student, _ = models
    batch = _batch(seed=2)
    loss = make_logit_distill_loss(make_token_loss("forward_kl", alpha=1.0))
    v, i = teacher_topk_fn(student, 4)(batch)
    stored = {"teacher_logp": np.asarray(v), "teacher_ids": np.asarray(i)}
    for frozen, extra in (({"teacher": student}, {}), (None, stored)):  # the full teacher, its stored top-k
        _, n, m = loss(student, {**batch, **extra}, frozen)
        agree, count = m["distill/top1_agreement"]
        assert float(agree) == float(count) == float(n) == 18
        assert abs(float(m["distill/divergence"][0])) < 1e-4
