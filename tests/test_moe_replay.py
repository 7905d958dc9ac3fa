"""Routing replay on the model side (`posttrain.models.moe`): the forward returns the experts its router chose
(compact ids [B, T, L_sparse, k]) and takes replayed ones, routing each token to them with gate weights from the
current router's softmax over all experts; `router_agreement` compares two choices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.algorithms.sft import token_logprobs
from posttrain.models import from_pretrained, moe
from posttrain.models.layers import RMSNorm
from posttrain.models.moe_loss import router_agreement
from posttrain.models.tiny import resolve_model_path


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return resolve_model_path("tiny:qwen3_moe", cache_dir=tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def mixed_moe(tmp_path_factory):
    """Qwen3-MoE with a dense first layer (`mlp_only_layers`): replay ids cover the sparse layers only."""
    from test_moe_parity import build_hf

    out = tmp_path_factory.mktemp("mixed")
    build_hf("qwen3_moe").save_pretrained(out)
    return out


def _batch(vocab, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(2, 9))
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


def _complement(own: np.ndarray, num_experts: int) -> np.ndarray:
    """Per token, the k experts with the smallest ids outside its own choice (a forced disagreement)."""
    out = np.zeros_like(own)
    for idx in np.ndindex(own.shape[:-1]):
        rest = [e for e in range(num_experts) if e not in set(own[idx].tolist())]
        out[idx] = rest[: own.shape[-1]]
    return out


@pytest.mark.parametrize("kernels,scan", [("cpu", True), ("generic", False)])
@pytest.mark.slow
def test_routing_output_and_replaying_own_choices_changes_nothing(mixed_moe, kernels, scan):
    model = from_pretrained(mixed_moe, kernels=kernels, scan_layers=scan)
    ids, mask = _batch(model.cfg.vocab_size)
    fwd = nnx.jit(lambda m, i, a, r: m(i, attention_mask=a, routing=True, replay=r))
    plain = nnx.jit(lambda m, i, a: m(i, attention_mask=a))(model, ids, mask)
    logits, routing = nnx.jit(lambda m, i, a: m(i, attention_mask=a, routing=True))(model, ids, mask)
    assert np.array_equal(np.asarray(plain), np.asarray(logits))  # asking for the routing changes nothing
    cfg = model.cfg
    sparse = sum(cfg.moe_layers)
    assert routing.experts.shape == (2, 9, sparse, cfg.num_experts_per_tok) and routing.experts.dtype == jnp.int8
    own = np.asarray(routing.experts)
    top = np.asarray(jax.lax.top_k(jax.nn.softmax(routing.logits.astype(jnp.float32)), 2)[1])  # [Ls, N, k]
    assert np.array_equal(own, top.reshape(sparse, 2, 9, 2).transpose(1, 2, 0, 3))
    replayed, again = fwd(model, ids, mask, own)
    assert np.array_equal(np.asarray(replayed), np.asarray(logits))  # full agreement: identical logits
    assert np.array_equal(np.asarray(again.experts), own)
    partial = own.astype(np.int32)
    partial[0, 2:5] = -1  # not recorded: the router's own choice
    assert np.array_equal(np.asarray(fwd(model, ids, mask, partial)[0]), np.asarray(logits))
    with pytest.raises(ValueError, match="replay has shape"):
        model(ids, attention_mask=mask, replay=own[:, :, :1])


def _logprob_sum(m, ids, mask, replay):
    return jnp.sum(token_logprobs(m, ids, attention_mask=mask, replay=replay) * mask[:, 1:])


@pytest.mark.slow
def test_router_gradients_under_replay(tiny_moe):
    """Gate weights of replayed experts come from the router's softmax, so the router gets a gradient; with the
    model's own choices replayed the gradients equal those without replay."""
    model = from_pretrained(tiny_moe)
    ids, mask = _batch(model.cfg.vocab_size, seed=1)
    own = np.asarray(model(ids, attention_mask=mask, routing=True)[1].experts)
    grad = nnx.jit(nnx.grad(_logprob_sum))
    flat = lambda g: {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(g)}
    base, same = flat(grad(model, ids, mask, None)), flat(grad(model, ids, mask, own))
    forced = flat(grad(model, ids, mask, _complement(own, model.cfg.num_experts)))
    router = "layers/moe/gate/kernel"
    for layer in range(model.cfg.num_layers):
        assert np.abs(forced[router][layer]).max() > 1e-4 and np.abs(same[router][layer]).max() > 1e-4
    for name in base:
        np.testing.assert_allclose(same[name], base[name], atol=1e-6, rtol=1e-5)
    assert np.abs(forced["layers/moe/experts/up_proj"] - base["layers/moe/experts/up_proj"]).max() > 1e-4


@pytest.mark.full_optimization
@pytest.mark.slow
def test_forced_disagreement_matches_a_hand_computation(tiny_moe, monkeypatch):
    """The last layer's tokens forced onto the experts their router did not choose: the model's log-probs equal a
    float64 numpy computation of that layer (softmax over all experts, gathered, renormalised; SwiGLU experts), the
    final norm and the LM head, from the layer's input and residual captured on the way."""
    model = from_pretrained(tiny_moe, scan_layers=False)
    cfg = model.cfg
    ids, mask = _batch(cfg.vocab_size, seed=2)
    own = np.asarray(model(ids, attention_mask=mask, routing=True)[1].experts)
    replay = own.copy()
    replay[:, :, -1] = _complement(own[:, :, -1], cfg.num_experts)
    seen = {"moe": [], "norm": []}
    moe_call, norm_call = moe.SparseMoE.__call__, RMSNorm.__call__

    def spy_moe(self, x, replay=None, mesh=None):
        out = moe_call(self, x, replay, mesh)
        seen["moe"].append((np.asarray(x), np.asarray(out[0])))
        return out

    def spy_norm(self, x):
        seen["norm"].append(np.asarray(x))
        return norm_call(self, x)

    monkeypatch.setattr(moe.SparseMoE, "__call__", spy_moe)
    monkeypatch.setattr(RMSNorm, "__call__", spy_norm)
    mine = np.asarray(token_logprobs(model, ids, attention_mask=mask))  # eager, unrolled: the own routing
    forced = np.asarray(token_logprobs(model, ids, attention_mask=mask, replay=replay))
    h, y_own = (a.astype(np.float64) for a in seen["moe"][cfg.num_layers - 1])  # the last layer, first pass
    residual = seen["norm"][len(seen["norm"]) // 2 - 1].astype(np.float64) - y_own  # final norm's input - experts

    last = lambda v: np.asarray(v[...][-1], np.float64)
    probs = _softmax(h @ last(model.layers.moe.gate.kernel))  # [B, T, E]
    choice = replay[:, :, -1].astype(np.int64)
    w = np.take_along_axis(probs, choice, -1)
    w = w / w.sum(-1, keepdims=True)  # norm_topk_prob
    gate, up, down = (last(getattr(model.layers.moe.experts, k)) for k in moe.EXPERT_WEIGHTS)
    y = np.zeros_like(h)
    for j in range(cfg.num_experts_per_tok):
        e = choice[..., j]
        g = np.einsum("btd,btdf->btf", h, gate[e])
        act = g / (1 + np.exp(-g)) * np.einsum("btd,btdf->btf", h, up[e])
        y += w[..., j:j + 1] * np.einsum("btf,btfd->btd", act, down[e])
    z = residual + y
    hf = z / np.sqrt(np.mean(z * z, -1, keepdims=True) + cfg.rms_norm_eps) * np.asarray(model.norm.weight[...])
    logits = hf @ np.asarray(model.output_kernel(), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    want = np.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1)[..., 0]
    real = mask[:, 1:].astype(bool)
    assert np.abs(forced - mine)[real].max() > 1e-2  # the disagreement matters
    np.testing.assert_allclose(forced[real], want[real], atol=2e-5)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("kernels", ["cpu", "generic"])
@pytest.mark.slow
def test_cached_calls_return_the_uncached_choices(tiny_moe, kernels):
    """What a sampler records: the experts of a prefill and of each decode step equal the uncached forward's."""
    from posttrain.models import KVCache

    model = from_pretrained(tiny_moe, kernels=kernels)
    ids, mask = _batch(model.cfg.vocab_size, seed=3)
    want = np.asarray(model(ids, attention_mask=mask, routing=True)[1].experts)
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    step = nnx.jit(lambda m, c, i, a, p: m(i, attention_mask=a, positions=p, cache=c, routing=True))
    cache = KVCache.create(model.cfg, 2, 16)
    _, cache, routing = step(model, cache, ids[:, :6], mask[:, :6], pos[:, :6])
    got = [np.asarray(routing.experts)]
    for t in range(6, 9):
        _, cache, routing = step(model, cache, ids[:, t:t + 1], mask[:, t:t + 1], pos[:, t:t + 1])
        got.append(np.asarray(routing.experts))
    real = mask.astype(bool)
    assert np.array_equal(np.concatenate(got, axis=1)[real], want[real])


def test_router_agreement_by_hand():
    cur = np.array([[[[0, 1], [2, 3]], [[1, 0], [0, 2]], [[3, 2], [1, 2]]]])  # [B=1, T=3, L=2, k=2]
    rep = np.array([[[[1, 0], [2, 1]], [[1, 0], [2, 0]], [[3, 1], [-1, -1]]]])
    # token 0: same, differs; token 1: same (order ignored), same; token 2: differs, not recorded (left out)
    assert float(router_agreement(cur, rep)) == pytest.approx(3 / 5)
    assert float(router_agreement(cur, rep, np.array([[1, 0, 1]]))) == pytest.approx(1 / 3)
    assert float(router_agreement(cur, cur)) == 1.0
    assert float(router_agreement(cur, np.full_like(cur, -1))) == 0.0
