"""Grouped-query self-attention with RoPE, masks (causal, padding, packed segments, sliding window) and a KV cache.

Two modes share one module:
- no cache (training, scoring): keys are the call's own tokens; a key is visible to a query when it is
  not after it, is a real token (`attention_mask`), lies in the same packed segment (`segment_ids`)
  and, on sliding-window layers, is less than `sliding_window` positions back.
- with a `KVCache` (sampling): the cache is slot-indexed, `[layers, slots, max_len, kv_heads, head_dim]`;
  a token at position p of slot b writes its key/value at `[b, p]`, and queries attend to cache
  entries j <= p that hold real tokens (`KVCache.valid`). Prefill and decode are the same call with
  different lengths, and each slot advances independently (continuous batching).

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
    """Slot-indexed KV cache: k, v [layers, slots, max_len, kv_heads, head_dim]; valid [slots, max_len]."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array

    @staticmethod
    def create(cfg: ModelConfig, slots: int, max_len: int, dtype=None) -> "KVCache":
        dtype = dtype or jnp.dtype(cfg.compute_dtype)
        shape = (cfg.num_layers, slots, max_len, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((slots, max_len), bool))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def reset_slots(self, slots_mask: jax.Array) -> "KVCache":
        """Marks every entry of the slots where `slots_mask` [slots] is True as empty."""
        return dataclasses.replace(self, valid=self.valid & ~slots_mask[:, None])

    def mark(self, positions: jax.Array, token_mask: jax.Array) -> "KVCache":
        """Records which (slot, position) entries the current call fills with real tokens."""
        b = jnp.arange(positions.shape[0])[:, None]
        pos = jnp.clip(positions, 0, self.max_len - 1)
        return dataclasses.replace(self, valid=self.valid.at[b, pos].set(token_mask.astype(bool)))


def _attend_one(q, k, v, mask, cfg: ModelConfig):
    """`_attend` for one query per row (decode): multiply-and-reduce over the cache in its [B,S,K,H] layout,
    so XLA neither transposes the cache nor runs many tiny batched matmuls."""
    b, _, n, h = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, 1, kvh, n // kvh, h).astype(jnp.float32)  # [B,1,K,G,H]
    logits = jnp.sum(qg * k[:, :, :, None, :].astype(jnp.float32), axis=-1) * cfg.attn_scale  # [B,S,K,G]
    if cfg.attn_logit_softcap is not None:
        cap = cfg.attn_logit_softcap
        logits = jnp.tanh(logits / cap) * cap
    logits = jnp.where(mask[:, 0, 0, :, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=1)
    out = jnp.sum(probs[..., None] * v[:, :, :, None, :].astype(jnp.float32), axis=1)  # [B,K,G,H]
    return out.reshape(b, 1, n, h).astype(q.dtype)


def _attend(q, k, v, mask, cfg: ModelConfig):
    """softmax(q k^T * scale [softcapped]) v with GQA; q [B,T,N,H], k/v [B,S,K,H], mask [B,1,T,S] bool."""
    if q.shape[1] == 1 and k.shape[1] > 1 and jax.default_backend() == "cpu":
        return _attend_one(q, k, v, mask, cfg)
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
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * cfg.attn_scale
    cap = cfg.attn_logit_softcap
    logits = jnp.tanh(logits / cap) * cap
    logits = jnp.where(mask[:, :, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
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

        `mask_info` holds what the mask needs (see `Transformer`); with `cache_kv=(k_all, v_all, valid, layer)`
        (the stacked cache [layers, B, S, K, H] and this layer's index) the new keys/values are written at
        [layer, b, positions] and the updated stacked (k_all, v_all) come back.
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
            # Write the new keys/values into the stacked cache first, then read this layer's rows: reading
            # before writing makes XLA copy the whole carried cache to keep the old value alive.
            k_all, v_all, valid, layer = cache_kv
            b = jnp.arange(x.shape[0])[:, None]
            pos = jnp.clip(positions, 0, k_all.shape[2] - 1)
            k_all = k_all.at[layer, b, pos].set(k.astype(k_all.dtype))
            v_all = v_all.at[layer, b, pos].set(v.astype(v_all.dtype))
            j = jnp.arange(k_all.shape[2])[None, None, :]
            qp = positions[:, :, None]
            mask = valid[:, None, :] & (j <= qp)
            if window:
                mask = mask & (~sliding | (qp - j < window))
            new_cache = (k_all, v_all)
            k = jax.lax.dynamic_index_in_dim(k_all, layer, 0, keepdims=False).astype(q.dtype)
            v = jax.lax.dynamic_index_in_dim(v_all, layer, 0, keepdims=False).astype(q.dtype)
        out = _attend(q, k, v, mask[:, None], cfg)
        return self.o_proj(out), new_cache
