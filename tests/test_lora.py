"""LoRA / QLoRA: stacked adapters, only adapters train, merge == adapters, switch-off == base, NF4 base weights;
attach, quantise and merge one compiled program each, bit for bit what eager per-leaf ops give."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compile_counter import count_compiles
from flax import nnx

from posttrain.algorithms.sft import make_sft_loss, token_logprobs
from posttrain.models import lora
from posttrain.models.config import llama_like
from posttrain.models.moe import Experts
from posttrain.models.transformer import init_model
from posttrain.training.trainer import Trainer

CFG = llama_like(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
ALL = r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
MOE = llama_like(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def fresh():
    graphdef, state = nnx.split(init_model(CFG, seed=0))
    return lambda: nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


def _batches(n, b=4, t=16, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, CFG.vocab_size, size=(b, t)).astype(np.int32)
        mask = np.ones((b, t), np.float32)
        mask[:, 0] = 0
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


@pytest.mark.slow
def test_attach_shapes_and_identity_at_init(fresh):
    model = fresh()
    ids = jnp.asarray(_batches(1)[0]["input_ids"])
    base = model(ids)
    paths = lora.attach(model, rank=4, alpha=8.0, target=r".*(q_proj|o_proj|down_proj)")
    assert paths == ["layers.mlp.down_proj", "layers.self_attn.o_proj", "layers.self_attn.q_proj"]
    q, o = model.layers.self_attn.q_proj, model.layers.self_attn.o_proj
    assert q.lora_a.shape == (2, 64, 4) and q.lora_b.shape == (2, 4, 4, 16)  # [L, *in, r], [L, r, *out]
    assert o.lora_a.shape == (2, 4, 16, 4) and o.lora_b.shape == (2, 4, 64)
    assert q.lora_scale == 2.0 and isinstance(q.lora_a, nnx.LoRAParam)
    assert q.lora_a.out_sharding == ("layers", "embed", "lora_rank")
    assert model.layers.self_attn.k_proj.lora_a is None
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(base))  # B = 0: same function
    with pytest.raises(ValueError, match="matches no linear module.*lm_head"):
        lora.attach(model, rank=4, alpha=8.0, target="nothing")
    with pytest.raises(ValueError, match="already has"):
        lora.attach(model, rank=4, alpha=8.0, target=r".*q_proj")


@pytest.mark.slow
def test_only_adapters_train_merge_equals_adapters_and_switch_off_is_base(fresh):
    model = fresh()
    batches = _batches(3)
    ids = jnp.asarray(batches[0]["input_ids"])
    base_logits = np.asarray(model(ids))
    base_lp = np.asarray(token_logprobs(model, ids))
    lora.attach(model, rank=4, alpha=16.0, target=ALL + "|lm_head", init="gaussian")
    base_before = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    tr = Trainer(model, optax.adamw(3e-2), loss_fn=make_sft_loss(chunk_size=24))
    assert tr.has_lora and tr.num_trainable == lora.lora_param_count(model)
    adapters_before = jax.tree.map(np.asarray, tr.params)
    losses = [tr.step(batches[i % 3])["loss"] for i in range(6)]
    assert losses[-1] < losses[0]

    # Frozen base untouched, every adapter (A and B) moved.
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(tr.rest)):
        np.testing.assert_array_equal(a, np.asarray(b))
    for a, b in zip(jax.tree.leaves(adapters_before), jax.tree.leaves(tr.params)):
        assert np.abs(a - np.asarray(b)).max() > 0

    # Adapters off == the base model (RL's reference policy without a second copy of the weights).
    np.testing.assert_allclose(np.asarray(tr.token_logprobs(batches[0], adapters=False)), base_lp, atol=1e-5)
    trained_lp = np.asarray(tr.token_logprobs(batches[0]))
    assert np.abs(trained_lp - base_lp).max() > 1e-2
    live = tr.model()
    with lora.disabled(live):
        np.testing.assert_allclose(np.asarray(live(ids)), base_logits, atol=1e-5)
    assert all(lin.lora_enabled for _, lin in lora.linears(live))

    # Merged model == model with adapters, and no adapter is left.
    with_adapters = np.asarray(live(ids))
    lora.merge(live)
    assert not lora.has_lora(live)
    assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(nnx.state(live)))
    np.testing.assert_allclose(np.asarray(live(ids)), with_adapters, atol=2e-5, rtol=1e-5)
    # The merge really changed the kernels: W' = W + (alpha/r) A @ B.
    assert np.abs(np.asarray(live(ids)) - base_logits).max() > 1e-2
    # ...of the merged copy only: the trainer's own (shared) state keeps base and adapters apart.
    np.testing.assert_allclose(np.asarray(tr.token_logprobs(batches[0])), trained_lp, atol=1e-6)


@pytest.mark.slow
def test_merge_formula_by_hand():
    model = init_model(llama_like(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                  num_kv_heads=1))
    lora.attach(model, rank=2, alpha=6.0, target=r".*up_proj")
    lin = model.layers.mlp.up_proj
    a = np.arange(1 * 16 * 2, dtype=np.float32).reshape(1, 16, 2) / 100
    b = np.ones((1, 2, 32), np.float32) / 10
    lin.lora_a.set_value(jnp.asarray(a))
    lin.lora_b.set_value(jnp.asarray(b))
    w = np.asarray(lin.kernel[...])
    lora.merge(model)
    np.testing.assert_allclose(np.asarray(model.layers.mlp.up_proj.kernel[...]), w + 3.0 * a @ b, rtol=1e-6, atol=1e-7)
    assert model.layers.mlp.up_proj.lora_a is None


def test_nf4_quantisation_blocks():
    import qwix

    model = init_model(CFG)
    up = model.layers.mlp.up_proj
    w = np.array(up.kernel[...])  # [L=2, in=64, out=128]
    # Plant exact NF4 code values times a per-block absmax in one block: they must come back exactly.
    code = np.asarray(qwix._src.core.numerics.get_nf4_buckets())
    w[0, :, 3] = np.tile(code, 4) * 0.37
    up.kernel.set_value(jnp.asarray(w))
    paths = lora.quantize_base(model, target=r".*up_proj")
    assert paths == ["layers.mlp.up_proj"]
    assert isinstance(up.kernel, lora.QuantizedKernel) and up.kernel[...].dtype == jnp.uint4
    assert up.quant.scale.shape == (2, 1, 128)  # one absmax per 64 inputs, per output unit, per layer
    deq = np.asarray(up.base_kernel())
    np.testing.assert_allclose(deq[0, :, 3], w[0, :, 3], rtol=1e-6)
    # Elsewhere the error is bounded by half the widest code-book gap times the block's absmax.
    absmax = np.abs(w).max(axis=1, keepdims=True)
    assert np.all(np.abs(deq - w) <= 0.5 * 0.3039 * absmax + 1e-6)
    # o_proj's inputs are (heads=4, head_dim=16): no input axis of 64, so its output axis (64) is blocked.
    lora.quantize_base(model, target=r".*o_proj")
    assert model.layers.self_attn.o_proj.quant.scale.shape == (2, 4, 16, 1)


# ------------------------------------------------------------------ one program per tree, equal to eager leaf-wise ops
def _bitwise(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    assert got.tobytes() == want.tobytes()


def _at_most_one_program(compiles, name: str) -> None:
    """`name` compiled at most once (not at all when an earlier case compiled the same shapes), nothing else."""
    assert set(compiles.names) <= {f"jit({name})"} and compiles.total <= 1, compiles


def _site(model, path: str):
    """(A, B, fan_in) of the adapter at `path` (a Linear's, or an expert weight's `ExpertAdapter`), or (the weight,)
    where there is none."""
    *mods, last = path.split(".")
    owner = functools.reduce(getattr, mods, model)
    if isinstance(owner, Experts):
        adapter, w = getattr(owner, last + "_lora"), getattr(owner, last)
        return (w[...],) if adapter is None else (adapter.lora_a[...], adapter.lora_b[...], w[...].shape[-2])
    lin = getattr(owner, last)
    return (lin.kernel[...],) if lin.lora_a is None else (lin.lora_a[...], lin.lora_b[...], math.prod(lin.in_shape))


def _eager_merged(model) -> dict:
    """Every merged weight computed leaf by leaf with eager ops: W (dequantised) + (alpha / r) A @ B."""
    want = {}
    for path, lin in lora.linears(model):
        if lin.lora_a is None and lin.quant is None:
            continue
        w = lin.base_kernel().astype(jnp.float32)
        if lin.lora_a is not None:
            a, b = lin.lora_a[...], lin.lora_b[...]
            lead, r = a.shape[:1] if path.startswith("layers.") else (), a.shape[-1]
            d = jnp.matmul(a.reshape(*lead, -1, r), b.reshape(*lead, r, -1), precision=jax.lax.Precision.HIGHEST)
            w = w + (lin.lora_scale * d).reshape(w.shape)
        want[path] = w.astype(lin.quant.dtype if lin.quant is not None else lin.kernel[...].dtype)
    for path, experts, kind in lora.expert_weights(model):
        w, adapter = getattr(experts, kind)[...], getattr(experts, kind + "_lora")
        want[path] = (w.astype(jnp.float32) + adapter.delta(jnp.float32)).astype(w.dtype)
    return want


@pytest.mark.parametrize("init,rank,alpha", [("kaiming", 4, 8.0), ("gaussian", 3, 7.0)])
@pytest.mark.slow
def test_attach_quantize_merge_one_program_each_equal_to_eager_leafwise_ops(init, rank, alpha):
    """A mixture of experts (attention Linears, lm_head, stacked expert weights): adapters, QLoRA's NF4 codes and
    scales, and the merged weights are each made by one compiled program, bit for bit what eager ops give leaf by
    leaf (A from fold_in(key(seed), i); qwix's quantize of each kernel; W + (alpha / r) A @ B)."""
    import qwix

    model = init_model(MOE, seed=0)
    with count_compiles() as made:
        paths = lora.attach(model, rank=rank, alpha=alpha, target=ALL + "|lm_head", seed=7, init=init)
    _at_most_one_program(made, "_lora_init")
    assert {"layers.moe.experts.down_proj", "layers.self_attn.q_proj", "lm_head"} <= set(paths)
    key = jax.random.key(7)
    for i, path in enumerate(paths):
        a, b, fan_in = _site(model, path)
        k = jax.random.fold_in(key, i)
        bound = 1.0 / math.sqrt(fan_in)
        want = (jax.random.uniform(k, a.shape, jnp.float32, -bound, bound) if init == "kaiming"
                else jax.random.normal(k, a.shape, jnp.float32) / rank)
        _bitwise(a, want)
        _bitwise(b, jnp.zeros(b.shape, jnp.float32))

    kernels = {p: lin.kernel[...] for p, lin in lora.linears(model) if p != "lm_head" and lin.lora_a is not None}
    with count_compiles() as quantised:
        assert sorted(lora.quantize_base(model, target=ALL)) == sorted(kernels)
    _at_most_one_program(quantised, "_nf4_quantize")
    for path, lin in lora.linears(model):
        if path in kernels:
            w = kernels[path]
            ax, tile = lora._block_axis(w.shape, 1, len(lin.in_shape), 64)
            q = qwix.quantize(w.astype(jnp.float32), "nf4", channelwise_axes=[i for i in range(w.ndim) if i != ax],
                              tiled_axes={ax: tile})
            _bitwise(lin.kernel[...], q.qvalue)
            _bitwise(lin.quant.scale[...], q.scale)

    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))):
        if path[-1] == "lora_b":  # B starts at zero: make the merge move every weight
            var.set_value(0.05 * jax.random.normal(jax.random.fold_in(key, 100 + i), var.get_value().shape))
    want = _eager_merged(model)
    with count_compiles() as merged:
        lora.merge(model)
    _at_most_one_program(merged, "_lora_merge")
    assert sorted(want) == sorted(paths) and not lora.has_lora(model)
    for path in paths:
        _bitwise(_site(model, path)[0], want[path])
