"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE) against `transformers` 5.23: logits, HF export, routing.

Each family is a tiny random checkpoint built here with transformers + torch (hidden 32, 4 experts, top-2, 3 layers;
Qwen3-MoE with a dense layer through `mlp_only_layers` and one through `decoder_sparse_step`), every weight random
(norms and biases too) so that parity means something.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch

from posttrain.models import expert_kernels, from_pretrained, save_pretrained
from posttrain.models.moe import route

#: tests comparing numbers with transformers compile as users' runs do (tests/conftest.py)
reference = pytest.mark.full_optimization

TOL = 1e-4
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, num_experts_per_tok=2)
FAMILIES = {
    # qwen3_moe: layer 0 dense (mlp_only_layers); qwen3_moe_step: layers 0 and 2 dense (decoder_sparse_step=2)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=24, mlp_only_layers=[0], decoder_sparse_step=1,
                       norm_topk_prob=True, rope_theta=1e6)),
    "qwen3_moe_step": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       dict(num_experts=4, moe_intermediate_size=24, decoder_sparse_step=2, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=24)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40)),
}


def build_hf(family: str, seed: int = 0):
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(family)
            build_hf(family).save_pretrained(out)
            made[family] = out
        return made[family]

    return get


def _batch(seed=0, vocab=96):
    """Two left-padded rows (9 and 6 real tokens) in a width of 10."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(2, 10))
    mask = np.zeros((2, 10), np.int64)
    mask[0, 1:] = 1
    mask[1, 4:] = 1
    ids[mask == 0] = 0
    return ids, mask


def _hf_logits(model, ids, mask):
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos))
    return out.logits.float().numpy()


def _load_hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _max_diff(ours, ref, mask):
    real = mask.astype(bool)
    return float(np.abs(np.asarray(ours)[real] - ref[real]).max())


@reference
@pytest.mark.parametrize("family,kernels", [(f, "cpu") for f in FAMILIES] + [("qwen3_moe", "generic"),
                                                                            ("qwen2_moe", "generic")])
@pytest.mark.slow
def test_logits_match_transformers(family, kernels, checkpoint):
    """cpu: dense expert compute; generic: grouped (`ragged_dot`), on the mixed dense/sparse and shared-expert models."""
    path = checkpoint(family)
    ids, mask = _batch()
    ref = _hf_logits(_load_hf(path), ids, mask)
    model = from_pretrained(path, kernels=kernels)
    ours = model(ids, attention_mask=mask)
    assert ours.dtype == np.float32
    assert _max_diff(ours, ref, mask) <= TOL


def test_layer_kinds_follow_the_config(checkpoint):
    from posttrain.models import load_config

    assert load_config(checkpoint("qwen3_moe"))[1].moe_layers == (False, True, True)
    assert load_config(checkpoint("qwen3_moe_step"))[1].moe_layers == (False, True, False)
    cfg = load_config(checkpoint("mixtral"))[1]
    assert cfg.moe_layers == (True,) * 3 and cfg.norm_topk_prob and cfg.moe_intermediate_size == 24


@reference
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_hf_export_round_trip(family, checkpoint, tmp_path):
    """Our export loads in transformers with equal logits, under the names `save_pretrained` writes, and back."""
    src = checkpoint(family)
    model = from_pretrained(src)
    out = save_pretrained(model, tmp_path / "export")
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "np") as f:
        ours_names = set(f.keys())
    with safe_open(src / "model.safetensors", "np") as f:
        hf_names = set(f.keys())
    assert ours_names == hf_names
    ids, mask = _batch(seed=3)
    ref = _hf_logits(_load_hf(out), ids, mask)
    mine = np.asarray(model(ids, attention_mask=mask))
    assert _max_diff(mine, ref, mask) <= TOL
    again = np.asarray(from_pretrained(out)(ids, attention_mask=mask))
    assert np.abs(again - mine).max() == 0.0
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["model_type"] == family and hf_cfg["num_experts_per_tok"] == 2


@pytest.mark.slow
def test_fused_expert_layout_loads(checkpoint, tmp_path):
    """A checkpoint holding transformers' fused 3D expert tensors (gate_up_proj, down_proj) loads the same."""
    from safetensors.numpy import load_file, save_file

    src = checkpoint("qwen3_moe")
    tensors = load_file(src / "model.safetensors")
    fused = {}
    for layer in (1, 2):
        base = f"model.layers.{layer}.mlp.experts"
        gate = [tensors.pop(f"{base}.{e}.gate_proj.weight") for e in range(4)]
        up = [tensors.pop(f"{base}.{e}.up_proj.weight") for e in range(4)]
        down = [tensors.pop(f"{base}.{e}.down_proj.weight") for e in range(4)]
        fused[f"{base}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        fused[f"{base}.down_proj"] = np.stack(down)
    folder = tmp_path / "fused"
    folder.mkdir()
    save_file({**tensors, **fused}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text((src / "config.json").read_text())
    ids, mask = _batch()
    a = np.asarray(from_pretrained(src)(ids, attention_mask=mask))
    b = np.asarray(from_pretrained(folder)(ids, attention_mask=mask))
    assert np.abs(a - b).max() == 0.0


@reference
def test_routing_matches_transformers_router():
    """softmax in float32, top-k, renormalised or not: transformers' Qwen3-MoE router on the same logits."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    for norm in (False, True):
        cfg = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3, norm_topk_prob=norm)
        router = Qwen3MoeTopKRouter(cfg)
        torch.manual_seed(0)
        with torch.no_grad():
            router.weight.copy_(torch.randn(6, 16))
        x = torch.randn(20, 16)
        _, w_ref, idx_ref = router(x)
        logits = (x @ router.weight.T).detach().numpy()
        w, idx = route(jax.numpy.asarray(logits), 3, norm)
        np.testing.assert_array_equal(np.asarray(idx), idx_ref.numpy())
        np.testing.assert_allclose(np.asarray(w), w_ref.detach().numpy(), atol=1e-6)


@pytest.mark.slow
def test_grouped_and_dense_expert_compute_agree():
    """The accelerator set's grouped (ragged_dot) and the CPU set's dense expert compute: values and gradients."""
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    n, d, f, e, k = 37, 16, 12, 5, 2
    x = jax.random.normal(keys[0], (n, d))
    ws = [jax.random.normal(kk, s) / 4 for kk, s in zip(keys[1:4], [(e, d, f), (e, d, f), (e, f, d)])]
    top_w, top_idx = route(jax.random.normal(keys[4], (n, e)), k, True)

    def value_and_grads(fn):
        def loss(x, *ws):
            return (fn(x, *ws, top_idx, top_w) ** 2).sum()

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, *ws)

    (v_grouped, g_grouped), (v_dense, g_dense) = value_and_grads(expert_kernels.grouped), value_and_grads(
        expert_kernels.dense)
    np.testing.assert_allclose(float(v_grouped), float(v_dense), rtol=1e-5)
    for a, b in zip(g_grouped, g_dense):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def test_active_parameters(checkpoint):
    from posttrain.models import hf_io, load_config

    cfg = load_config(checkpoint("qwen2_moe"))[1]
    counted, _ = hf_io.count_checkpoint_params(checkpoint("qwen2_moe"))
    assert cfg.num_params() == counted
    experts_unused = 3 * (4 - 2) * 32 * 24 * 3  # 3 sparse layers, 2 of 4 experts idle per token
    assert cfg.num_params(active=True) == counted - experts_unused
    desc = cfg.describe()
    assert desc["experts"].startswith("4 x 24, top-2") and "active parameters" in desc
    q3 = load_config(checkpoint("qwen3_moe"))[1]
    assert q3.num_params() == hf_io.count_checkpoint_params(checkpoint("qwen3_moe"))[0]


@pytest.mark.parametrize("kernels", ["cpu", "generic"])
@pytest.mark.slow
def test_cached_prefill_and_decode_match_uncached(kernels, checkpoint):
    """The sampler's calls (a KV cache: prefill, then one token per call) route as the uncached forward does."""
    from flax import nnx

    from posttrain.models import KVCache

    model = from_pretrained(checkpoint("qwen3_moe"), kernels=kernels)
    ids, mask = _batch(seed=4)
    full = np.asarray(model(ids, attention_mask=mask))
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    cache = KVCache.create(model.cfg, ids.shape[0], 16)
    step = nnx.jit(lambda m, c, i, mk, p: m(i, attention_mask=mk, positions=p, cache=c))
    logits, cache = step(model, cache, ids[:, :7], mask[:, :7], pos[:, :7])
    outs = [np.asarray(logits)]
    for t in range(7, 10):
        logits, cache = step(model, cache, ids[:, t:t + 1], mask[:, t:t + 1], pos[:, t:t + 1])
        outs.append(np.asarray(logits))
    assert _max_diff(np.concatenate(outs, axis=1), full, mask) <= 1e-5


@reference
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.slow
def test_tiny_models_load_in_transformers(family, tmp_path):
    """`tiny:qwen3_moe` and `tiny:mixtral` are HF checkpoints transformers loads with equal logits."""
    from posttrain.models.tiny import resolve_model_path

    path = resolve_model_path(f"tiny:{family}", cache_dir=tmp_path)
    model = from_pretrained(path)
    assert model.cfg.num_experts == 4 and model.cfg.num_experts_per_tok == 2
    ids, mask = _batch(seed=5, vocab=model.cfg.vocab_size)
    assert _max_diff(model(ids, attention_mask=mask), _hf_logits(_load_hf(path), ids, mask), mask) <= TOL


@pytest.mark.slow
def test_router_and_expert_gradients_are_nonzero(checkpoint):
    from flax import nnx

    model = from_pretrained(checkpoint("qwen2_moe"))
    ids, mask = _batch()
    grads = nnx.grad(lambda m: (m(ids, attention_mask=mask) ** 2).mean())(model)
    flat = {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}
    for name in ("layers/moe/gate/kernel", "layers/moe/experts/gate_proj", "layers/moe/experts/down_proj",
                 "layers/moe/shared_expert_gate/kernel", "layers/moe/shared_expert/up_proj/kernel"):
        assert np.isfinite(flat[name]).all() and np.abs(flat[name]).max() > 0, name


@reference
@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(masked):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from posttrain.models.moe_loss import load_balancing_loss

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 20, 6)).astype(np.float32) * 2
    mask = (rng.random((2, 10)) > 0.3).astype(np.int64) if masked else None
    ref = load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), 6, 2,
                                   torch.tensor(mask) if masked else None)
    ours = load_balancing_loss(jax.numpy.asarray(logits), 2, None if mask is None else mask.reshape(-1))
    np.testing.assert_allclose(float(ours), float(ref), rtol=1e-6)


@reference
@pytest.mark.parametrize("family,scan", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
@pytest.mark.slow
def test_router_logits_and_aux_loss_match_transformers(family, scan, checkpoint):
    """The sparse layers' router logits, the load-balancing loss over them, and the logits, as transformers returns
    them, with the layers scanned and unrolled."""
    from posttrain.models.moe_loss import load_balancing_loss

    path = checkpoint(family)
    hf = _load_hf(path)
    ids, mask = _batch(seed=6)
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos),
                 output_router_logits=True)
    model = from_pretrained(path, scan_layers=scan)
    h, _, routing = model.hidden_states(ids, attention_mask=mask, routing=True)
    routers = routing.logits
    assert _max_diff(model.logits(h), out.logits.numpy(), mask) <= TOL
    ref = np.stack([r.numpy() for r in out.router_logits])
    assert routers.shape == ref.shape
    real = mask.reshape(-1).astype(bool)
    assert np.abs(np.asarray(routers)[:, real] - ref[:, real]).max() <= TOL
    cfg = model.cfg
    aux = load_balancing_loss(routers, cfg.num_experts_per_tok, mask.reshape(-1))
    np.testing.assert_allclose(float(aux), float(out.aux_loss), rtol=1e-5)


@pytest.mark.slow
def test_router_z_loss_and_stats_by_hand():
    from posttrain.models.moe_loss import router_stats, router_z_loss

    logits = np.log(np.array([[[0.7, 0.2, 0.1], [0.1, 0.2, 0.7], [0.6, 0.3, 0.1]]], np.float32))  # 1 layer, 3 tokens
    mask = np.array([1, 1, 0])
    assert abs(float(router_z_loss(logits, mask))) < 1e-6  # probabilities: logsumexp = log 1 = 0
    np.testing.assert_allclose(float(router_z_loss(logits + 2.0, mask)), 4.0, rtol=1e-6)
    stats = router_stats(logits, 1, mask)
    assert float(stats["load_max"]) == 0.5  # experts 0 and 2 get one of the two real tokens each
    h = -(0.7 * np.log(0.7) + 0.2 * np.log(0.2) + 0.1 * np.log(0.1))
    np.testing.assert_allclose(float(stats["entropy"]), h, rtol=1e-5)
    assert float(router_stats(logits, 2, mask)["load_max"]) == 1.0  # with top-2, expert 1 is in both tokens' choice
