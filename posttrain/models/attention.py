"""Grouped-query self-attention with RoPE, masks (causal, padding, packed segments, sliding window) and a KV cache.

Two modes share one module:
- no cache (training, scoring): keys are the call's own tokens; a key is visible to a query when it is
  not after it, is a real token (`attention_mask`), lies in the same packed segment (`segment_ids`; a negative
  id marks a shared prefix that every segment of its row sees) and, on sliding-window layers, is less than
  `sliding_window` positions back.
- with a `KVCache` (sampling): the cache is slot-indexed, one pair of arrays per layer, laid out as the
  model's kernel set wants (`posttrain.models.kernels`: [slots, max_len, kv_heads, head_dim] for the
  generic path, keys transposed for the CPU path); a token at position p of slot b writes its key/value at
  position p of slot b, and queries attend to cache entries j <= p that hold real tokens (`KVCache.valid`).
  Prefill and decode are the same call with different lengths, and each slot advances independently
  (continuous batching). Per-layer arrays (not one stacked array) let each layer update its cache in place
  and read it whole, with no per-step slice copies.

Attention itself goes through the kernel set (`jax.nn.dot_product_attention`, cuDNN flash attention on GPU
where it applies); Gemma 2's attention-logit soft-capping needs the logits, so that case uses an explicit
einsum path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models import kernels as kernels_lib
from posttrain.models.config import ModelConfig
from posttrain.models.layers import Linear, RMSNorm, apply_rope


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Slot-indexed KV cache: per layer k and v arrays in the layout of the model's kernel set
    (`posttrain.models.kernels`; `kernels.cache_shapes`), and valid [slots, max_len] marking the entries
    holding real tokens."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array

    @staticmethod
    def create(cfg: ModelConfig, slots: int, max_len: int, dtype=None) -> "KVCache":
        dtype = dtype or jnp.dtype(cfg.compute_dtype)
        k_shape, v_shape = kernels_lib.get(cfg).cache_shapes(cfg.num_kv_heads, cfg.head_dim, slots, max_len)
        return KVCache(tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers)),
                       tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.num_layers)),
                       jnp.zeros((slots, max_len), bool))

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def reset_slots(self, slots_mask: jax.Array) -> "KVCache":
        """Marks every entry of the slots where `slots_mask` [slots] is True as empty."""
        return dataclasses.replace(self, valid=self.valid & ~slots_mask[:, None])

    def mark(self, positions: jax.Array, token_mask: jax.Array) -> "KVCache":
        """Records which (slot, position) entries the current call fills with real tokens."""
        b = jnp.arange(positions.shape[0])[:, None]
        pos = jnp.clip(positions, 0, self.max_len - 1)
        return dataclasses.replace(self, valid=self.valid.at[b, pos].set(token_mask.astype(bool)))


class Attention(nnx.Module):
    """One attention layer: q/k/v projections, optional q/k RMSNorm, RoPE, masked GQA, output projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, kv, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.kernels = kernels_lib.resolve(cfg.kernels)
        self.q_proj = Linear((d,), (n, h), ("embed",), ("heads", "head_dim"), bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.k_proj = Linear((d,), (kv, h), ("embed",), ("kv_heads", "head_dim"), bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.v_proj = Linear((d,), (kv, h), ("embed",), ("kv_heads", "head_dim"), bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.o_proj = Linear((n, h), (d,), ("heads", "head_dim"), ("embed",), bias=cfg.o_bias, cfg=cfg, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg=cfg, axis_name="head_dim")
            self.k_norm = RMSNorm(h, cfg=cfg, axis_name="head_dim")
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, *, rope, mask_info, sliding, cache_kv=None, positions=None):
        """x [B,T,D]; rope = (cos, sin); sliding: bool scalar for this layer.

        `mask_info` holds what the mask needs (see `Transformer`); with `cache_kv=(k, v, valid)` (this layer's
        cache arrays, in the kernel set's layout, and the cache's valid mask) the new keys/values
        are written at their positions and the updated (k, v) come back.
        """
        cfg, ks = self.cfg, kernels_lib.get(self.kernels)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        window = cfg.sliding_window or 0
        if cache_kv is None:
            qi, ki = mask_info["q_index"], mask_info["k_index"]  # [B,T,1], [B,1,T]
            mask = mask_info["base"]
            if window:
                mask = mask & (~sliding | (qi - ki < window))
            return self.o_proj(ks.attend(q, k, v, mask[:, None], cfg, causal=mask_info["causal"])), None
        # This layer's cache arrays: write the new keys/values at their positions, then attend over the
        # whole row (masked by `valid` and causality).
        k_c, v_c, valid = cache_kv
        k_c, v_c = ks.cache_write(k_c, v_c, k, v, positions)
        j = jnp.arange(valid.shape[1])[None, None, :]
        qp = positions[:, :, None]
        mask = j <= qp
        if mask_info is not None and "image_overlay" in mask_info:  # a prefill's images: bidirectional within each
            mask = mask | mask_info["image_overlay"]
        mask = valid[:, None, :] & mask
        if window:
            mask = mask & (~sliding | (qp - j < window))
        out = ks.attend_cached(q, k_c, v_c, mask[:, None], cfg)
        return self.o_proj(out), (k_c, v_c)
