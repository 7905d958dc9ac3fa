"""Grouped-query self-attention with RoPE, masks (causal, padding, packed segments, sliding window) and a KV cache.

Two modes share one module:
- no cache (training, scoring): keys are the call's own tokens; a key is visible to a query when it is
  not after it, is a real token (`attention_mask`), lies in the same packed segment (`segment_ids`)
  and, on sliding-window layers, is less than `sliding_window` positions back.
- with a `KVCache` (sampling): the cache is slot-indexed, one pair of arrays per layer: keys
  `[slots, kv_heads, head_dim, max_len]` (transposed) and values `[slots, kv_heads, max_len, head_dim]`;
  a token at position p of slot b writes its key/value at position p of slot b, and queries attend to
  cache entries j <= p that hold real tokens (`KVCache.valid`). Prefill and decode are the same call
  with different lengths, and each slot advances independently (continuous batching). Per-layer arrays
  (not one stacked array) let each layer update its cache in place and read it whole, with no per-step
  slice copies. The layouts serve the decode step: q.k sums over head_dim with positions contiguous,
  p.v sums over positions with head_dim contiguous, so both products stream the cache along rows (on
  CPU, about twice as fast as summing q.k along the contiguous head_dim).

Attention itself goes through `jax.nn.dot_product_attention` (a fused cuDNN kernel on GPU where it
applies); Gemma 2's attention-logit soft-capping needs the logits, so that case uses an explicit einsum path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models.config import ModelConfig
from posttrain.models.layers import Linear, RMSNorm, apply_rope


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Slot-indexed KV cache, per layer: k [slots, kv_heads, head_dim, max_len] (keys transposed) and
    v [slots, kv_heads, max_len, head_dim]; valid [slots, max_len] marks the entries holding real tokens."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array

    #: logical axis names of one layer's k and v arrays (for `posttrain.distributed`)
    K_AXES = ("batch", "kv_heads", "head_dim", "seq")
    V_AXES = ("batch", "kv_heads", "seq", "head_dim")

    @staticmethod
    def create(cfg: ModelConfig, slots: int, max_len: int, dtype=None) -> "KVCache":
        dtype = dtype or jnp.dtype(cfg.compute_dtype)
        k_shape, v_shape = KVCache.layer_shapes(cfg.num_kv_heads, cfg.head_dim, slots, max_len)
        return KVCache(tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers)),
                       tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.num_layers)),
                       jnp.zeros((slots, max_len), bool))

    @staticmethod
    def layer_shapes(kv_heads: int, head_dim: int, slots: int, max_len: int):
        """(k shape, v shape) of one layer."""
        return (slots, kv_heads, head_dim, max_len), (slots, kv_heads, max_len, head_dim)

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


def _probs(logits, mask, cfg: ModelConfig):
    """softmax over keys of float32 q.k logits: scaled, soft-capped (Gemma 2) when configured, masked."""
    logits = logits * cfg.attn_scale
    if cfg.attn_logit_softcap is not None:
        cap = cfg.attn_logit_softcap
        logits = jnp.tanh(logits / cap) * cap
    return jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1)


def _attend_one(q, k_t, v, mask, cfg: ModelConfig):
    """Attention of one query per row (decode) over a cache in its layouts (k_t [B,K,H,S], v [B,K,S,H]):
    per (slot, kv head) a [G,H] x [H,S] and a [G,S] x [S,H] product, each reading the cache along
    contiguous rows (see the module docstring), accumulated in float32. q [B,1,N,H], mask [B,1,1,S]."""
    b, _, n, h = q.shape
    kvh = k_t.shape[1]
    qg = q.reshape(b, kvh, n // kvh, h)  # [B,K,G,H]
    logits = jnp.einsum("bkgh,bkhs->bkgs", qg, k_t, preferred_element_type=jnp.float32)
    probs = _probs(logits, mask[:, :, 0, None, :], cfg).astype(v.dtype)
    out = jnp.einsum("bkgs,bksh->bkgh", probs, v, preferred_element_type=jnp.float32)  # [B,K,G,H]
    return out.reshape(b, 1, n, h).astype(q.dtype)


def _attend(q, k, v, mask, cfg: ModelConfig):
    """softmax(q k^T * scale [softcapped]) v with GQA; q [B,T,N,H], k/v [B,S,K,H], mask [B,1,T,S] bool."""
    if cfg.attn_logit_softcap is None:
        impl = None if cfg.attention_impl == "auto" else cfg.attention_impl
        if impl is None and jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
            try:
                return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=cfg.attn_scale, implementation="cudnn")
            except Exception:  # shapes or masks cuDNN does not take: fall back to XLA
                pass
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=cfg.attn_scale, implementation=impl)
    b, t, n, h = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, n // kvh, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    probs = _probs(logits, mask[:, :, None], cfg).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, n, h)


class Attention(nnx.Module):
    """One attention layer: q/k/v projections, optional q/k RMSNorm, RoPE, masked GQA, output projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, kv, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
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
        cache arrays, k [B, K, H, S] and v [B, K, S, H], and the cache's valid mask) the new keys/values
        are written at their positions and the updated (k, v) come back.
        """
        cfg = self.cfg
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
            new_cache = None
        else:
            # This layer's cache arrays (k transposed): write the new keys/values at their positions, then
            # attend over the whole row (masked by `valid` and causality).
            k_c, v_c, valid = cache_kv
            b = jnp.arange(x.shape[0])[:, None]
            pos = jnp.clip(positions, 0, v_c.shape[2] - 1)
            k_c = k_c.at[b, :, :, pos].set(k.astype(k_c.dtype))  # index [B,T] + slices K, H -> value [B,T,K,H]
            v_c = v_c.at[b, :, pos].set(v.astype(v_c.dtype))
            j = jnp.arange(v_c.shape[2])[None, None, :]
            qp = positions[:, :, None]
            mask = valid[:, None, :] & (j <= qp)
            if window:
                mask = mask & (~sliding | (qp - j < window))
            new_cache = (k_c, v_c)
            if x.shape[1] == 1 and jax.default_backend() == "cpu":
                out = _attend_one(q, k_c.astype(q.dtype), v_c.astype(q.dtype), mask[:, None], cfg)
                return self.o_proj(out), new_cache
            k = k_c.transpose(0, 3, 1, 2).astype(q.dtype)  # [B, S, K, H] for the many-query path
            v = v_c.swapaxes(1, 2).astype(q.dtype)
        out = _attend(q, k, v, mask[:, None], cfg)
        return self.o_proj(out), new_cache
