"""Building blocks of the Transformer: linear maps (with optional LoRA adapters), the gated MLP, RMSNorm, embeddings,
RoPE.

Every parameter is an `nnx.Param` carrying logical axis names (names such as "embed", "heads",
"mlp", "vocab"); `posttrain.distributed` maps those names onto a device mesh.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models import kernels as kernels_lib
from posttrain.models.config import ModelConfig, RopeConfig


def param(value: jax.Array, axes, kind=nnx.Param) -> nnx.Variable:
    """A parameter with logical axis names (flax's `out_sharding` metadata; no eager placement)."""
    return kind(value, out_sharding=tuple(axes), eager_sharding=False)


def logical_axes(variable: nnx.Variable):
    """The logical axis names of a parameter (with the leading "layers" axis of stacked blocks)."""
    return getattr(variable, "out_sharding", None)


def dtype_of(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def _letters(n: int, start: int) -> str:
    return "".join(chr(ord("a") + start + i) for i in range(n))


class Linear(nnx.Module):
    """y = x @ W (+ b) over several input and output axes, W shaped [*in_shape, *out_shape].

    LoRA (Hu et al. 2021, arXiv:2106.09685) adds `(alpha / r) * (x @ A) @ B` with A [*in, r] and
    B [r, *out] held as `nnx.LoRAParam`; `posttrain.models.lora` attaches and merges them.
    With QLoRA the base kernel is stored quantised (NF4) and dequantised on the fly.
    """

    def __init__(self, in_shape, out_shape, in_axes, out_axes, *, bias: bool, cfg: ModelConfig, rngs: nnx.Rngs,
                 name: str = ""):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        pdtype = dtype_of(cfg.param_dtype)
        fan_in = math.prod(self.in_shape)
        init = jax.random.normal(rngs.params(), (*self.in_shape, *self.out_shape), pdtype) * (1.0 / math.sqrt(fan_in))
        self.kernel = param(init, (*in_axes, *out_axes))
        self.bias = param(jnp.zeros(self.out_shape, pdtype), out_axes) if bias else None
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        self.kernels = kernels_lib.resolve(cfg.kernels)  # the product (and its backward) of the kernel set
        self.name = name
        self.lora_a = None
        self.lora_b = None
        self.lora_scale = 0.0
        self.lora_enabled = True
        self.quant = None  # set by posttrain.models.lora.quantize_base (QLoRA)

    def base_kernel(self) -> jax.Array:
        if self.quant is not None:
            return self.quant.dequantize(self.kernel[...])
        return self.kernel[...]

    def __call__(self, x: jax.Array) -> jax.Array:
        n_in, n_out = len(self.in_shape), len(self.out_shape)
        xs = _letters(x.ndim - n_in, 0)
        ins = _letters(n_in, 10)
        outs = _letters(n_out, 16)
        cd = self.compute_dtype
        x = x.astype(cd)
        y = kernels_lib.get(self.kernels).contract(x, self.base_kernel().astype(cd), n_in)
        if self.lora_a is not None and self.lora_enabled:
            r = "z"
            a = jnp.einsum(f"{xs}{ins},{ins}{r}->{xs}{r}", x, self.lora_a[...].astype(cd))
            y = y + self.lora_scale * jnp.einsum(f"{xs}{r},{r}{outs}->{xs}{outs}", a, self.lora_b[...].astype(cd))
        if self.bias is not None:
            y = y + self.bias[...].astype(cd)
        return y


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU with tanh-approximate gelu (Gemma).
    `width`: the hidden width (default `cfg.intermediate_size`; a Qwen2-MoE shared expert has its own)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int | None = None):
        d, f, b = cfg.hidden_size, width or cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear((d,), (f,), ("embed",), ("mlp",), bias=b, cfg=cfg, rngs=rngs)
        self.up_proj = Linear((d,), (f,), ("embed",), ("mlp",), bias=b, cfg=cfg, rngs=rngs)
        self.down_proj = Linear((f,), (d,), ("mlp",), ("embed",), bias=b, cfg=cfg, rngs=rngs)
        self.act = cfg.hidden_act

    def __call__(self, x):
        g = self.gate_proj(x)
        g = jax.nn.silu(g) if self.act == "silu" else jax.nn.gelu(g, approximate=True)
        return self.down_proj(g * self.up_proj(x))


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x^2) + eps) * w, or * (1 + w) for Gemma.

    Normalisation runs in float32 and casts back, as the reference implementations do.
    """

    def __init__(self, dim: int, *, cfg: ModelConfig, axis_name: str = "norm"):
        init = jnp.zeros if cfg.norm_offset else jnp.ones
        self.weight = param(init((dim,), dtype_of(cfg.param_dtype)), (axis_name,))
        self.eps = cfg.rms_norm_eps
        self.offset = cfg.norm_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...].astype(jnp.float32)
        if self.offset:
            return (xf * (1.0 + w)).astype(dtype)
        # Llama/Qwen: the normalised activations are cast to the input dtype before the weight multiply.
        return (w * xf.astype(dtype).astype(jnp.float32)).astype(dtype)


class Embed(nnx.Module):
    """Token embedding table [vocab, embed]; also the tied output projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pdtype = dtype_of(cfg.param_dtype)
        self.embedding = param(
            jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), pdtype) * 0.02, ("vocab", "embed")
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)


# ---------------------------------------------------------------------- RoPE
def rope_inv_freq(rope: RopeConfig, head_dim: int) -> jax.Array:
    """Inverse frequencies theta^(-2i/d), with the `linear` or `llama3` (Llama 3.1) scaling rule applied."""
    inv = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = jnp.where(medium, smoothed, scaled)
    return inv


def rope_tables(positions: jax.Array, rope: RopeConfig, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [batch, seq, head_dim] (float32) for integer positions [batch, seq]."""
    freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(rope, head_dim)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [batch, seq, heads, head_dim] by the half-split (GPT-NeoX) convention, in float32."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(dtype)
