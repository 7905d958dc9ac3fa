"""The SigLIP vision encoder (Zhai et al. 2023, arXiv:2303.15343) of Gemma 3, in Flax NNX.

`SiglipEncoder(pixel_values [N, C, H, W])` -> patch features [N, num_patches, hidden] (compute dtype):
- patch embedding: the stride-`patch` convolution as one matmul over each patch's C x p x p pixels (its
  kernel stored [C, p, p, hidden], HF's conv weight [hidden, C, p, p] transposed), plus a bias;
- learned position embeddings, one per patch (row-major over the patch grid);
- pre-norm encoder layers (LayerNorm, bidirectional multi-head attention with biases, LayerNorm, GELU MLP),
  stacked on a leading "layers" axis and scanned (or unrolled, `cfg.scan_layers`), rematerialised per
  `cfg.remat`, in `cfg.compute_dtype` like the text layers;
- a final LayerNorm (`post_layernorm`). The attention-pooling head of SigLIP is not used by Gemma 3.

Parameters take the text model's logical axis names (embed, heads, head_dim, mlp), so the same sharding
rules place them on the mesh; the position table's patch axis is "vision_patches" (replicated).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import distributed
from posttrain.models import kernels as kernels_lib
from posttrain.models.config import ModelConfig
from posttrain.models.layers import Linear, dtype_of, param
from posttrain.models.vision_config import VisionConfig


@dataclasses.dataclass(frozen=True)
class _AttnNumerics:
    """What the kernel set's `attend` reads from a config: SigLIP's scale, no soft-cap."""

    attn_scale: float
    attention_impl: str
    attn_logit_softcap: None = None


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias, normalised in float32 and cast back to the input dtype."""

    def __init__(self, dim: int, *, eps: float, cfg: ModelConfig):
        pdtype = dtype_of(cfg.param_dtype)
        self.weight = param(jnp.ones((dim,), pdtype), ("norm",))
        self.bias = param(jnp.zeros((dim,), pdtype), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class SiglipAttention(nnx.Module):
    """Bidirectional multi-head self-attention over one image's patches (q/k/v/out projections with biases)."""

    def __init__(self, vc: VisionConfig, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, h = vc.hidden_size, vc.num_heads, vc.head_dim
        self.q_proj = Linear((d,), (n, h), ("embed",), ("heads", "head_dim"), bias=True, cfg=cfg, rngs=rngs)
        self.k_proj = Linear((d,), (n, h), ("embed",), ("heads", "head_dim"), bias=True, cfg=cfg, rngs=rngs)
        self.v_proj = Linear((d,), (n, h), ("embed",), ("heads", "head_dim"), bias=True, cfg=cfg, rngs=rngs)
        self.out_proj = Linear((n, h), (d,), ("heads", "head_dim"), ("embed",), bias=True, cfg=cfg, rngs=rngs)
        self.numerics = _AttnNumerics(attn_scale=h ** -0.5, attention_impl=cfg.attention_impl)
        self.kernels = kernels_lib.resolve(cfg.kernels)

    def __call__(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        out = kernels_lib.get(self.kernels).attend(q, k, v, None, self.numerics)
        return self.out_proj(out)


class SiglipMLP(nnx.Module):
    """fc2(gelu(fc1(x))), tanh-approximate GELU unless the config says exact."""

    def __init__(self, vc: VisionConfig, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = vc.hidden_size, vc.intermediate_size
        self.fc1 = Linear((d,), (f,), ("embed",), ("mlp",), bias=True, cfg=cfg, rngs=rngs)
        self.fc2 = Linear((f,), (d,), ("mlp",), ("embed",), bias=True, cfg=cfg, rngs=rngs)
        self.approximate = vc.hidden_act == "gelu_tanh"

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=self.approximate))


class SiglipLayer(nnx.Module):
    """x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, vc: VisionConfig, cfg: ModelConfig, rngs: nnx.Rngs):
        self.layer_norm1 = LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps, cfg=cfg)
        self.self_attn = SiglipAttention(vc, cfg, rngs)
        self.layer_norm2 = LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps, cfg=cfg)
        self.mlp = SiglipMLP(vc, cfg, rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nnx.Module):
    """Patch embedding, position embeddings, stacked `SiglipLayer`s and the post-LayerNorm."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        vc = cfg.vision
        c, p, d = vc.num_channels, vc.patch_size, vc.hidden_size
        self.vc, self.cfg = vc, cfg
        self.patch_embedding = Linear((c, p, p), (d,), (None, None, None), ("embed",), bias=True, cfg=cfg, rngs=rngs)
        pdtype = dtype_of(cfg.param_dtype)
        self.position_embedding = param(jax.random.normal(rngs.params(), (vc.num_patches, d), pdtype) * 0.02,
                                        ("vision_patches", "embed"))

        @nnx.split_rngs(splits=vc.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs):
            return SiglipLayer(vc, cfg, rngs)

        self.layers = make_layers(rngs)
        self.post_layernorm = LayerNorm(d, eps=vc.layer_norm_eps, cfg=cfg)

    def patches(self, pixel_values: jax.Array) -> jax.Array:
        """[N, C, H, W] -> [N, num_patches, C, p, p], patches in row-major order of the grid."""
        vc = self.vc
        n, c, hgt, wid = pixel_values.shape
        if (c, hgt, wid) != (vc.num_channels, vc.image_size, vc.image_size):
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}; the vision tower takes "
                             f"[images, {vc.num_channels}, {vc.image_size}, {vc.image_size}]")
        p, s = vc.patch_size, vc.patches_per_side
        x = pixel_values.reshape(n, c, s, p, s, p).transpose(0, 2, 4, 1, 3, 5)
        return x.reshape(n, s * s, c, p, p)

    def __call__(self, pixel_values: jax.Array, mesh=None) -> jax.Array:
        cfg = self.cfg
        cd = dtype_of(cfg.compute_dtype)
        x = self.patch_embedding(self.patches(pixel_values.astype(cd)))
        x = x + self.position_embedding[...].astype(cd)[None]
        graphdef, state = nnx.split(self.layers)

        def body(h, state_l):
            h = nnx.merge(graphdef, state_l)(h)
            return distributed.constrain(h, ("batch", "seq", "act_embed"), mesh), None

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=kernels_lib.get(cfg).remat_policy(cfg.remat),
                                  prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            x, _ = jax.lax.scan(body, x, state)
        else:
            for i in range(self.vc.num_layers):
                x, _ = body(x, jax.tree.map(lambda a, i=i: a[i], state))
        return self.post_layernorm(x)
