"""The kernel sets' `contract` (the linear-layer product; the cpu set's with a hand-written backward pass) against
plain autodiff of tensordot, and the kernel switch's resolution."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models import kernels

pytestmark = pytest.mark.full_optimization  # numbers against a reference: compiled as users' runs are (tests/conftest.py)


@pytest.fixture(params=["cpu", "generic"])
def contract(request):
    return kernels.get(request.param).contract


@pytest.mark.parametrize("x_shape,w_shape,n_in", [
    ((2, 5, 8), (8, 6), 1),          # [B, T, D] @ [D, F]
    ((2, 5, 8), (8, 3, 4), 1),       # q/k/v projection: [D] -> [heads, head_dim]
    ((2, 5, 3, 4), (3, 4, 8), 2),    # output projection: [heads, head_dim] -> [D]
])
@pytest.mark.slow
def test_contract_matches_tensordot_values_and_gradients(contract, x_shape, w_shape, n_in):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape)
    w = jax.random.normal(kw, w_shape)
    out_shape = x_shape[: len(x_shape) - n_in] + w_shape[n_in:]
    g = jax.random.normal(kg, out_shape)  # a random cotangent, so every gradient entry is exercised

    def ours(x, w):
        return jnp.sum(contract(x, w, n_in) * g)

    def ref(x, w):
        return jnp.sum(jnp.tensordot(x, w, axes=n_in) * g)

    np.testing.assert_allclose(contract(x, w, n_in), jnp.tensordot(x, w, axes=n_in), rtol=1e-6, atol=1e-6)
    gx, gw = jax.jit(jax.grad(ours, argnums=(0, 1)))(x, w)
    rx, rw = jax.grad(ref, argnums=(0, 1))(x, w)
    assert gx.shape == x.shape and gw.shape == w.shape
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-5)


def test_contract_out_dtype_accumulates_in_float32(contract):
    x = jnp.full((4, 64), 1.0 + 2.0**-7, jnp.bfloat16)  # 1.0078125: exact in bfloat16
    w = jnp.ones((64, 3), jnp.bfloat16)
    out = contract(x, w, 1, jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, 64 * (1.0 + 2.0**-7))  # 64.5: not representable in bfloat16 (64 or 65)
    gx, gw = jax.grad(lambda x, w: jnp.sum(contract(x, w, 1, jnp.float32)), argnums=(0, 1))(x, w)
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(gw, np.float32), 4 * (1.0 + 2.0**-7), rtol=1e-2)


@pytest.mark.slow
def test_kernel_switch_resolves_once_from_config_env_and_backend(monkeypatch):
    from posttrain.models.config import llama_like
    from posttrain.models.transformer import init_model

    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.resolve("auto") == ("cpu" if jax.default_backend() == "cpu" else "generic")
    assert kernels.resolve("generic") == "generic" and kernels.resolve("cpu") == "cpu"
    monkeypatch.setenv(kernels.ENV_VAR, "generic")
    assert kernels.resolve("auto") == "generic"
    assert kernels.resolve("cpu") == "cpu"  # an explicit choice wins over the environment
    model = init_model(llama_like(), seed=0)
    assert model.cfg.kernels == "generic"  # resolved when the model is built
    assert model.layers.self_attn.q_proj.kernels == "generic"
    monkeypatch.setenv(kernels.ENV_VAR, "tpu")
    with pytest.raises(ValueError, match="POSTTRAIN_KERNELS"):
        kernels.resolve("auto")
    with pytest.raises(ValueError, match="kernels="):
        llama_like(kernels="fast")


def _dot_precisions(fn, *args) -> set:
    """The `precision` of every dot_general in fn's jaxpr (nested jaxprs included), as strings."""
    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.add(str(eqn.params["precision"]))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_generic_float32_products_ask_for_highest_precision(compute_dtype):
    """On GPU/TPU a float32 product runs in TF32 / bf16 passes unless asked otherwise (an H100 put float32 logits
    3e-3..5e-3 from transformers'): the generic set traces float32 models at "highest", forward and backward;
    bfloat16 compute and the cpu set keep the default."""
    from posttrain.models.config import llama_like
    from posttrain.models.transformer import init_model

    ids = jnp.array([[1, 2, 3, 4]])
    for kset, want_highest in (("generic", compute_dtype == "float32"), ("cpu", False)):
        model = init_model(llama_like(kernels=kset, compute_dtype=compute_dtype), seed=0)
        fwd = _dot_precisions(lambda i: model(i), ids)
        grad = _dot_precisions(jax.grad(lambda e: model.logits(e).sum()),
                               jnp.ones((1, 2, model.cfg.hidden_size), jnp.dtype(compute_dtype)))
        for found in (fwd, grad):
            assert found, "no product traced"
            highest = {p for p in found if "HIGHEST" in p}
            assert (highest == found) if want_highest else not highest, (kset, compute_dtype, found)


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.slow
def test_cpu_many_query_cached_attention_matches_generic(softcap):
    """The cpu set's cached attention of several queries (its transposed key cache read without a transpose)
    against the generic set on the same keys in the [B, S, K, H] layout: GQA groups, padding and causal mask."""
    from types import SimpleNamespace

    b, t, s, n, kvh, h = 3, 5, 11, 4, 2, 8
    cfg = SimpleNamespace(attn_logit_softcap=softcap, attn_scale=h ** -0.5, attention_impl="auto")
    kq, kk, kv, km = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(kq, (b, t, n, h))
    k = jax.random.normal(kk, (b, s, kvh, h))
    v = jax.random.normal(kv, (b, s, kvh, h))
    pos = jnp.arange(t)[None, :] + jnp.array([0, 3, 6])[:, None]
    mask = (jnp.arange(s)[None, None, :] <= pos[:, :, None]) & jax.random.bernoulli(km, 0.8, (b, 1, s))
    mask = mask.at[:, :, 0].set(True)[:, None]  # [B, 1, T, S], every query sees a key
    want = jax.jit(lambda q, k, v, m: kernels.get("generic").attend_cached(q, k, v, m, cfg))(q, k, v, mask)
    got = jax.jit(lambda q, k, v, m: kernels.get("cpu").attend_cached(
        q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), m, cfg))(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal,softcap", [(True, None), (True, 30.0), (False, None)])
@pytest.mark.slow
def test_cpu_uncached_attention_matches_generic(causal, softcap, monkeypatch):
    """The cpu set's attention without a cache (its cache layouts; causal self-attention in query chunks that
    skip the later keys) against the generic set's dense attention: values and gradients of q, k and v, with
    packed segments, a shared prefix, padding and GQA, over more queries than one chunk holds."""
    from types import SimpleNamespace

    b, t, n, kvh, h = 2, 100, 4, 2, 8
    monkeypatch.setattr(kernels, "CAUSAL_MIN_CHUNK", 32)  # chunks of a few dozen queries, one of uneven length
    assert kernels.causal_chunk_bounds(t) == [0, 32, 64, 100]
    cfg = SimpleNamespace(attn_logit_softcap=softcap, attn_scale=h ** -0.5, attention_impl="auto")
    kq, kk, kv, kg, km = jax.random.split(jax.random.key(2), 5)
    q = jax.random.normal(kq, (b, t, n, h))
    k = jax.random.normal(kk, (b, t, kvh, h))
    v = jax.random.normal(kv, (b, t, kvh, h))
    g = jax.random.normal(kg, (b, t, n, h))
    seg = jnp.asarray(np.repeat([-1, 0, 1, 2], [20, 30, 41, 9])[None].repeat(b, 0))  # a shared prefix, 3 segments
    qi, ki = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    same = (seg[:, :, None] == seg[:, None, :]) | (seg[:, None, :] < 0)
    mask = same & jax.random.bernoulli(km, 0.9, (b, 1, t)) | (qi == ki)
    mask = (mask & (qi >= ki) if causal else mask)[:, None]  # [B, 1, T, T]

    def grads(kset):
        f = lambda q, k, v: jnp.sum(kernels.get(kset).attend(q, k, v, mask, cfg, causal=causal) * g)  # noqa: E731
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)

    (want, want_g), (got, got_g) = grads("generic"), grads("cpu")
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for a, b_ in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-4, atol=1e-5)
