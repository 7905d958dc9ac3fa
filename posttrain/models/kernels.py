"""Kernel sets: the one place where the code differs by backend (`ModelConfig.kernels: auto | generic | cpu`).

`auto` resolves once, when a model is built (`resolve`): the environment variable `POSTTRAIN_KERNELS`
(generic | cpu) when it is set (the test suite forces the generic path with it), else `cpu` on JAX's CPU
backend and `generic` everywhere else. Model, attention and sampler code never look at the backend; they
ask the kernel set of their config (`get(cfg)`).

`generic` (GPU, TPU; also runs on CPU): what an accelerator compiler wants.
- Linear maps are plain `jnp.tensordot` products with autodiff's backward (the remat policies see them); on
  XLA:CPU in float32, long contractions sum two half-length products (`product`: float32 parity).
- The KV cache stores k and v as [slots, max_len, kv_heads, head_dim], the layout of
  `jax.nn.dot_product_attention`; no step transposes it.
- Attention is `jax.nn.dot_product_attention`; with `attention_impl: auto` on a GPU in bf16/fp16 it asks
  for cuDNN flash attention, and falls back to XLA's implementation only when cuDNN reports the
  configuration unsupported (`NotImplementedError`, raised while tracing) or a static check rules it out
  (head_dim > 256 or not a multiple of 8); any other error propagates.
- Cached calls of many tokens (prefill) scan over the layers (one compiled layer body); one-token calls
  (decode) unroll them so that each layer updates its own cache buffers in place (a stacked cache in a
  scan would copy every layer's cache slice each step, tripling the memory traffic of decode).
- Sampling draws with `jax.random.categorical` (Gumbel-max).
- Mixture-of-experts layers run their experts as grouped matmuls over the token-expert pairs sorted by expert
  (`jax.lax.ragged_dot`, `posttrain.models.expert_kernels.grouped`): work proportional to the top k.

16-bit compute (both sets): products of bfloat16 or float16 operands accumulate in float32 with the dot algorithm
the backend has (`half_dot_algorithms`, decided once per backend): XLA:CPU has no F16_F16_F32, so its float16
products widen their operands (F32_F32_F32), and the generic set's attention leaves jax.nn's (which asks for
F16_F16_F32) for the explicit one there. Whether a backend runs a dtype at all is found once by running a tiny
program (`check_compute_dtype`: a one-line config error naming the key when it cannot).

`cpu` (XLA's CPU backend, tuned on a 2-core machine; identical results up to float rounding):
- `contract`: a hand-written backward whose weight gradient is x^T @ dy on an explicitly transposed x
  behind an optimization barrier (XLA:CPU otherwise feeds its matmul library a strided transposed copy
  of dy, about a fifth of a training step on the benchmark model).
- KV cache keys transposed per layer, k [slots, kv_heads, head_dim, max_len], values
  [slots, kv_heads, max_len, head_dim]; decode attention as two small batched products that stream the
  cache along rows (about twice as fast as summing q.k along the contiguous head_dim on CPU); cached calls
  of many tokens (prefill, continuation) stack each kv head's queries into the same two products, so no
  call transposes the cache.
- Attention without a cache (training, scoring) uses the same layouts as cached calls (`attend_uncached`), and
  causal self-attention of 512 tokens or more runs in query chunks, each against the keys up to its end only:
  the masked half of the scores is never computed.
- Cached calls unroll the layers; the decode loop slices the per-layer weights once, outside its
  `while_loop` (on CPU a slice inside the loop is a copy every step).
- Sampling inverts a two-level CDF at one uniform number per row (Gumbel-max's V random numbers per row
  dominate a CPU decode step).
- Mixture-of-experts layers run every token through every expert and combine by the routing matrix
  (`expert_kernels.dense`): XLA:CPU lowers `ragged_dot` to a masked dense product over all groups for each of the
  N*k sorted rows (k times the dense work, plus the sort), so the dense form is as fast (D=F=128, 8 experts
  top-2: within the noise) or faster at every shape measured
  (`benchmarks/bench_moe_experts.py`, float32, forward / forward+backward, 2026-11-27, 2 cores shared with other
  jobs, so +-30%): tiny:qwen3_moe's layer on 2,304 tokens (D=64, 4 x 96, top-2) grouped 10 / 83-100 ms, dense
  5 / 25-54 ms; D=F=256, 16 experts top-2: 507-891 / 2,218-2,508 ms against 436-511 / 1,236-1,803 ms;
  D=256, F=128, 64 experts top-8: 1.6-2.7 / 8.5-10.6 s against 0.5 / 1.4-1.8 s.
"""

from __future__ import annotations

import functools
import math
import os
import types
import warnings

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from posttrain.config import ConfigError
from posttrain.models import expert_kernels

CHOICES = ("auto", "generic", "cpu")
LINEAR_NAME = "posttrain_linear"  # checkpoint name of the cpu set's linear products (see CpuKernels.remat_policy)
_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
ENV_VAR = "POSTTRAIN_KERNELS"


@functools.cache
def _platform() -> str:
    return jax.default_backend()


def resolve(name: str = "auto") -> str:
    """The concrete kernel set (`generic` or `cpu`) that `name` stands for (see the module docstring)."""
    if name not in CHOICES:
        raise ValueError(f"kernels={name!r}; accepted: {', '.join(CHOICES)}")
    if name != "auto":
        return name
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env and env != "auto":
        if env not in CHOICES:
            raise ValueError(f"{ENV_VAR}={env!r}; accepted: {', '.join(CHOICES)}")
        return env
    return "cpu" if _platform() == "cpu" else "generic"


def get(cfg_or_name) -> "GenericKernels":
    """The kernel set of a `ModelConfig` (its `kernels` field) or of a name."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else getattr(cfg_or_name, "kernels", "auto")
    return _SETS[resolve(name)]


# ---------------------------------------------------------------------- float32 products on XLA:CPU
#: float32 contractions over at least this many inputs accumulate in two halves on XLA's CPU backend ...
SPLIT_ACCUMULATION_MIN = 512
#: ... unless they have more outputs than this (LM heads: see `product`)
SPLIT_ACCUMULATION_MAX_OUT = 16384


def _splits_accumulation(x, w, n_in: int) -> bool:
    k = math.prod(w.shape[:n_in])
    lead = x.shape[: x.ndim - n_in]
    if len(lead) >= 2 and lead[-1] == 1:  # a one-token decode step: memory bound, and never position 0
        return False
    return (_platform() == "cpu" and x.dtype == jnp.float32 and w.dtype == jnp.float32
            and k >= SPLIT_ACCUMULATION_MIN and k % 2 == 0
            and math.prod(w.shape[n_in:]) <= SPLIT_ACCUMULATION_MAX_OUT)


def product(x, w, n_in: int, out_dtype=None):
    """`jnp.tensordot(x, w, n_in)`; on XLA:CPU in float32 a long contraction is the sum of two half-length ones.

    XLA:CPU's float32 matmul (YNNPACK) accumulates a contraction in one running sum. Llama-family models carry
    "massive activations" on their first token (|x| ~ 2.8e3 entering SmolLM2's layer-12 MLP down projection,
    outputs ~2.2e4): there one running sum over 1,536 products is off by ~5 ulp where PyTorch's CPU matmul is
    within 1 ulp, and that error reaches every logit of the position. Two half-length sums added at the end
    are within 1 ulp too. Measured on SmolLM2-135M's float32 logits against float64 (transformers): one
    running sum 1.5e-4, halves for contractions >= 1,024 long 7.3e-5, >= 512 long 6.3e-5 (PyTorch: 6.0e-5).
    LM heads (more than SPLIT_ACCUMULATION_MAX_OUT outputs) keep one product: their error is the rounding of
    their float32 input (PyTorch's is the same), and halves of a tied [vocab, d] table would be copies.
    Few rows: x is regrouped [2, rows, k/2] and one product is batched over the halves; many rows: two
    products on slices (the weight's halves are small against x). One-token decode steps ([slots, 1, k])
    keep one product: the batched halves cost ~15% of decode speed (bench model, 16 slots, measured), and
    the massive activations sit on position 0, which prefill computes, never a decode step.
    """
    if not _splits_accumulation(x, w, n_in):
        return jnp.tensordot(x, w, axes=n_in, preferred_element_type=out_dtype)
    k = math.prod(w.shape[:n_in])
    h = k // 2
    lead, outs = x.shape[: x.ndim - n_in], w.shape[n_in:]
    x2, w2 = x.reshape(-1, k), w.reshape(k, -1)
    if x2.shape[0] >= h:
        y = (jnp.dot(x2[:, :h], w2[:h], preferred_element_type=out_dtype)
             + jnp.dot(x2[:, h:], w2[h:], preferred_element_type=out_dtype))
    else:
        xs = x2.reshape(-1, 2, h).swapaxes(0, 1)
        y2 = jax.lax.dot_general(xs, w2.reshape(2, h, -1), (((2,), (1,)), ((0,), (0,))),
                                 preferred_element_type=out_dtype)
        y = y2[0] + y2[1]
    return y.reshape(*lead, *outs)


# ---------------------------------------------------------------------- shared attention math
def masked_probs(logits, mask, cfg):
    """softmax over keys of float32 q.k logits: scaled, soft-capped (Gemma 2) when configured, masked."""
    logits = logits * cfg.attn_scale
    if cfg.attn_logit_softcap is not None:
        cap = cfg.attn_logit_softcap
        logits = jnp.tanh(logits / cap) * cap
    return jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1)


def einsum_attention(q, k, v, mask, cfg):
    """Explicit GQA attention (for soft-capped logits, which the fused kernels do not take, and for 16-bit dtypes
    whose dot algorithm the backend lacks: `GenericKernels.attend`). q [B,T,N,H], k/v [B,S,K,H], mask [B,1,T,S]
    bool."""
    b, t, n, h = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, n // kvh, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32,
                        precision=half_dot_algorithms().get(jnp.dtype(q.dtype)))
    probs = masked_probs(logits, mask[:, :, None], cfg).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, n, h)


# ---------------------------------------------------------------------- causal attention in query chunks
#: the cpu set computes causal self-attention of T queries in up to this many query chunks ...
CAUSAL_CHUNKS = 8
#: ... of at least this many queries each (shorter calls: one dense attention). Each chunk adds its own ops to
#: the compiled program: 8 chunks of 36 queries made the GRPO benchmark's first step take 16 s instead of 9 s for
#: no faster update, while at T = 1,024 four chunks halve attention's time (see `attend_uncached`)
CAUSAL_MIN_CHUNK = 256


def causal_chunk_bounds(t: int) -> list[int]:
    """Query chunk boundaries [0, ..., t] for causal attention in chunks (`attend_uncached`; inner ones multiples
    of 8)."""
    n = max(1, min(CAUSAL_CHUNKS, t // CAUSAL_MIN_CHUNK))
    return [0, *((t * i // n) // 8 * 8 for i in range(1, n)), t]


def _uniform_rows(keys_fn):
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_fn())


# ---------------------------------------------------------------------- generic
class GenericKernels:
    """Plain JAX for accelerators (see the module docstring). Instances are stateless singletons."""

    name = "generic"
    #: cached calls with more than one token (prefill) scan over the layers when `cfg.scan_layers`
    scan_prefill = True
    #: the decode loop slices the per-layer weights once, before its `while_loop`
    preslice_decode_weights = False

    def __repr__(self):
        return f"<kernels {self.name}>"

    def remat_policy(self, remat: str):
        """The `jax.checkpoint` policy of `ModelConfig.remat` (none | full | dots | dots_no_batch) for this set."""
        return _REMAT_POLICIES[remat]

    def matmul_precision(self, compute_dtype: str) -> str | None:
        """The matmul precision a model's products are traced under (`jax.default_matmul_precision`).

        float32 compute asks for "highest": XLA:GPU otherwise runs float32 products in TF32 (and TPUs in
        bfloat16 passes), which put an H100's float32 logits 3e-3..5e-3 from transformers' (measured with the
        parity tests; "highest" brings them within 1e-4). bfloat16/float16 compute keeps the backend's default.
        """
        return "highest" if compute_dtype == "float32" else None

    # -------------------------------------------------------------- products
    def contract(self, x, w, n_in: int, out_dtype=None):
        """x [..., *in] @ w [*in, *out] -> [..., *out], accumulated and returned in `out_dtype` (`product`)."""
        return product(x, w, n_in, out_dtype)

    def experts(self, x, gate, up, down, top_idx, top_w, act: str):
        """A mixture-of-experts layer's experts on tokens x [N, D] (`posttrain.models.expert_kernels`)."""
        return expert_kernels.grouped(x, gate, up, down, top_idx, top_w, act)

    # -------------------------------------------------------------- KV cache layout
    k_axes = ("batch", "seq", "kv_heads", "head_dim")
    v_axes = ("batch", "seq", "kv_heads", "head_dim")
    k_seq_axis = 1
    v_seq_axis = 1

    def cache_shapes(self, kv_heads: int, head_dim: int, slots: int, max_len: int):
        """(k shape, v shape) of one layer's cache arrays."""
        s = (slots, max_len, kv_heads, head_dim)
        return s, s

    def cache_write(self, k_c, v_c, k, v, positions):
        """Writes k/v [B,T,K,H] of the call's tokens at their positions [B,T] of the layer's cache."""
        b = jnp.arange(k.shape[0])[:, None]
        pos = jnp.clip(positions, 0, v_c.shape[self.v_seq_axis] - 1)
        return k_c.at[b, pos].set(k.astype(k_c.dtype)), v_c.at[b, pos].set(v.astype(v_c.dtype))

    def attend_cached(self, q, k_c, v_c, mask, cfg):
        """Attention of q [B,T,N,H] over one layer's cache arrays; mask [B,1,T,S]."""
        return self.attend(q, k_c.astype(q.dtype), v_c.astype(q.dtype), mask, cfg)

    # -------------------------------------------------------------- attention
    def _flash_applies(self, q, cfg) -> bool:
        if cfg.attention_impl == "cudnn":
            return True
        return (cfg.attention_impl == "auto" and _platform() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
                and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0)

    def attend(self, q, k, v, mask, cfg, causal: bool = False):
        """softmax(q k^T * scale) v with GQA; q [B,T,N,H], k/v [B,S,K,H], mask [B,1,T,S] bool. `causal`: the
        caller's promise that `mask` is causal self-attention (the cpu set skips the masked half; see there).
        jax.nn's attention asks for the 16-bit dot algorithms of `_JAX_NN_ALGORITHMS`; where the backend lacks one
        (float16 on XLA:CPU) the explicit attention runs with the backend's (`half_dot_algorithms`)."""
        if cfg.attn_logit_softcap is not None or not _jax_nn_attention_runs(q.dtype):
            return einsum_attention(q, k, v, mask, cfg)
        if self._flash_applies(q, cfg):
            try:
                return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=cfg.attn_scale,
                                                    implementation="cudnn")
            except NotImplementedError as e:  # cuDNN's own "configuration not supported" checks
                if cfg.attention_impl == "cudnn":
                    raise
                _warn_once(f"cuDNN flash attention does not take this configuration ({e}); using XLA's attention")
        impl = "xla" if cfg.attention_impl in ("auto", "cudnn") else cfg.attention_impl
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=cfg.attn_scale, implementation=impl)

    # -------------------------------------------------------------- sampling
    def categorical(self, x, keys_fn):
        """One draw per row from softmax(x) (x [R, V] float32, -inf = excluded); keys_fn() -> keys [R].
        Returns (indices [R] int32, logsumexp(x) [R])."""
        tok = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys_fn(), x)
        return tok.astype(jnp.int32), jax.nn.logsumexp(x, axis=-1)


@functools.cache
def _warn_once(msg: str):
    warnings.warn(msg, stacklevel=3)


# ---------------------------------------------------------------------- cpu
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def contract_cpu(x: jax.Array, w: jax.Array, n_in: int, out_dtype=None) -> jax.Array:
    """`product(x, w, n_in)` with the CPU-tuned backward pass (see the module docstring)."""
    return product(x, w, n_in, out_dtype)


def _contract_fwd(x, w, n_in, out_dtype):
    return contract_cpu(x, w, n_in, out_dtype), (x, w)


def _contract_bwd(n_in, out_dtype, res, dy):
    x, w = res
    n_out = w.ndim - n_in
    out_axes = tuple(range(n_in, w.ndim))
    dx = jnp.tensordot(dy, w, axes=(tuple(range(dy.ndim - n_out, dy.ndim)), out_axes)).astype(x.dtype)
    d_in = math.prod(w.shape[:n_in])
    xt = jax.lax.optimization_barrier(x.reshape(-1, d_in).T)  # [in, tokens], materialised once
    dw = jnp.dot(xt, dy.reshape(-1, math.prod(w.shape[n_in:])).astype(xt.dtype),
                 preferred_element_type=jnp.float32)
    return dx, dw.reshape(w.shape).astype(w.dtype)


contract_cpu.defvjp(_contract_fwd, _contract_bwd)


def _first_true(cond: jax.Array, fallback: jax.Array) -> jax.Array:
    """Index of the first True along the last axis, or `fallback` where a row has none."""
    n = cond.shape[-1]
    first = jnp.min(jnp.where(cond, jnp.arange(n, dtype=jnp.int32), n), axis=-1)
    return jnp.where(first < n, first, fallback)


def _last_positive(w: jax.Array) -> jax.Array:
    """Index of the last entry > 0 along the last axis (0 if none)."""
    return jnp.max(jnp.where(w > 0, jnp.arange(w.shape[-1], dtype=jnp.int32), 0), axis=-1)


def sample_categorical(x: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draws one index per row from softmax(x) by inverting its CDF at u [R] ~ U[0, 1).

    The CDF is found in two levels (block sums over blocks of about sqrt(V) entries, then one block), so no
    full-length cumulative sum and only one uniform number per row are needed. Entries of x at -inf
    (filtered) have zero width and are never drawn. Returns (indices [R] int32, logsumexp(x) [R]).
    """
    r, v = x.shape
    bsize = 1 << max(0, (int(v ** 0.5) - 1).bit_length())  # a power of two >= sqrt(V)
    nb = -(-v // bsize)
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - m)
    if nb * bsize != v:
        e = jnp.pad(e, ((0, 0), (0, nb * bsize - v)))
    blocks = e.reshape(r, nb, bsize)
    bsum = jnp.sum(blocks, axis=-1)  # [R, nb]
    csum = jnp.cumsum(bsum, axis=-1)
    total = csum[:, -1]
    target = u * total
    b = _first_true(csum > target[:, None], _last_positive(bsum))  # the block holding the draw
    before = jnp.where(b > 0, jnp.take_along_axis(csum, jnp.maximum(b - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inner = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]  # [R, bsize]
    within = _first_true(jnp.cumsum(inner, axis=-1) + before[:, None] > target[:, None], _last_positive(inner))
    return (b * bsize + within).astype(jnp.int32), jnp.log(total) + m[:, 0]


def attend_one_query(q, k_t, v, mask, cfg):
    """Attention of one query per row (decode) over a cache in the CPU layouts (k_t [B,K,H,S], v [B,K,S,H]):
    per (slot, kv head) a [G,H] x [H,S] and a [G,S] x [S,H] product, accumulated in float32.
    q [B,1,N,H], mask [B,1,1,S]."""
    b, _, n, h = q.shape
    kvh = k_t.shape[1]
    qg = q.reshape(b, kvh, n // kvh, h)  # [B,K,G,H]
    logits = jnp.einsum("bkgh,bkhs->bkgs", qg, k_t, preferred_element_type=jnp.float32)
    probs = masked_probs(logits, mask[:, :, 0, None, :], cfg).astype(v.dtype)
    out = jnp.einsum("bkgs,bksh->bkgh", probs, v, preferred_element_type=jnp.float32)  # [B,K,G,H]
    return out.reshape(b, 1, n, h).astype(q.dtype)


#: the 16-bit dot algorithms jax.nn.dot_product_attention's XLA path asks for (jax 0.10.2), whatever the backend
_JAX_NN_ALGORITHMS = {jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
                      jnp.dtype(jnp.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32}


def _jax_nn_attention_runs(dtype) -> bool:
    """Whether jax.nn's attention runs in `dtype` here (its dot algorithm is the backend's own)."""
    d = jnp.dtype(dtype)
    return _JAX_NN_ALGORITHMS.get(d) == half_dot_algorithms().get(d)


@functools.cache
def half_dot_algorithms() -> dict:
    """16-bit operand dtype -> the dot algorithm of products that accumulate in float32 with their operands kept in
    16 bits (so that the backward's products stay 16-bit too, as jax.nn's attention does): BF16_BF16_F32 and
    F16_F16_F32, decided once for the backend. XLA:CPU has no F16_F16_F32 ("The precision 'F16_F16_F32' is not
    supported by dot_general on CPU", jax 0.10.2): there float16 products widen their operands (F32_F32_F32: what
    XLA:CPU computes a float16 product in anyway, float32 accumulation, rounded to float16 at the end)."""
    presets = jax.lax.DotAlgorithmPreset
    f16 = presets.F32_F32_F32 if _platform() == "cpu" else presets.F16_F16_F32
    return {jnp.dtype(jnp.bfloat16): presets.BF16_BF16_F32, jnp.dtype(jnp.float16): f16}


def attend_queries(q, k_t, v, mask, cfg, out_dtype=jnp.float32):
    """Attention of many queries per row (prefill, continuation) over a cache in the CPU layouts, without
    transposing the cache (a copy of every row): the queries of a kv head's group and all positions are
    stacked, [G*T,H] x [H,S] and [G*T,S] x [S,H] per (row, kv head), the logits in float32, the second product
    returned in `out_dtype` (None: v's dtype, so that a bfloat16 model's backward products stay bfloat16).
    q [B,T,N,H], k_t [B,K,H,S], v [B,K,S,H], mask [B,1,T,S]."""
    b, t, n, h = q.shape
    kvh, s = k_t.shape[1], k_t.shape[3]
    g = n // kvh
    qg = q.reshape(b, t, kvh, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, h)  # [B,K,G*T,H]
    # 16-bit operands: an explicit algorithm keeps the backward's products in them (as jax.nn's attention does)
    precision = half_dot_algorithms().get(jnp.dtype(q.dtype))
    logits = jnp.einsum("bkqh,bkhs->bkqs", qg, k_t, preferred_element_type=jnp.float32, precision=precision)
    m = jnp.broadcast_to(mask[:, :, None], (b, 1, g, t, s)).reshape(b, 1, g * t, s)
    probs = masked_probs(logits, m, cfg).astype(v.dtype)
    out = jnp.einsum("bkqs,bksh->bkqh", probs, v, preferred_element_type=out_dtype)  # [B,K,G*T,H]
    return out.reshape(b, kvh, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)


def attend_uncached(q, k, v, mask, cfg, causal: bool):
    """Attention without a cache (training, scoring) in the layouts of `attend_queries`: k and v transposed once to
    [B,K,H,S] / [B,K,S,H], the queries of a kv head's group stacked. With `causal` (the caller's promise that no
    query sees a later key) the queries run in chunks (`causal_chunk_bounds`), chunk [a, b) against keys [0, b)
    only: exact, as the keys dropped carry zero weight, and the scores cover (n+1)/2n of the dense T x T.
    Forward + backward of one attention layer on the 2-core CPU (4/2 heads x 64, 2026-11-27): 8 rows x 288
    (the GRPO benchmark's update) `jax.nn.dot_product_attention` 44 ms, these layouts 27 ms (8 chunks of 36
    queries: 16 ms); 2 rows x 1,024: `jax.nn.dot_product_attention` 163 ms, these layouts 129 ms, in 4 chunks
    71 ms.
    q [B,T,N,H], k/v [B,S,K,H], mask [B,1,T,S]."""
    k_t, v_t = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
    t, s = q.shape[1], k.shape[1]
    chunked = causal and t == s
    bounds = causal_chunk_bounds(t) if chunked else [0, t]
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        e = b if chunked else s  # the keys this chunk's queries may see
        outs.append(attend_queries(q[:, a:b], k_t[..., :e], v_t[:, :, :e], mask[:, :, a:b, :e], cfg, out_dtype=None))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


class CpuKernels(GenericKernels):
    """The CPU-tuned pieces (see the module docstring)."""

    name = "cpu"
    scan_prefill = False
    preslice_decode_weights = True

    def contract(self, x, w, n_in: int, out_dtype=None):
        # The custom_vjp call hides its product from remat policies: the name lets "dots" policies save it.
        return checkpoint_name(contract_cpu(x, w, n_in, out_dtype), LINEAR_NAME)

    def matmul_precision(self, compute_dtype: str) -> str | None:
        return None  # XLA:CPU computes float32 products in float32 whatever the precision asked

    def remat_policy(self, remat: str):
        policy = _REMAT_POLICIES[remat]
        if remat in ("dots", "dots_no_batch"):
            policy = jax.checkpoint_policies.save_from_both_policies(
                policy, jax.checkpoint_policies.save_only_these_names(LINEAR_NAME))
        return policy

    def experts(self, x, gate, up, down, top_idx, top_w, act: str):
        return expert_kernels.dense(x, gate, up, down, top_idx, top_w, act)

    k_axes = ("batch", "kv_heads", "head_dim", "seq")
    v_axes = ("batch", "kv_heads", "seq", "head_dim")
    k_seq_axis = 3
    v_seq_axis = 2

    def cache_shapes(self, kv_heads: int, head_dim: int, slots: int, max_len: int):
        return (slots, kv_heads, head_dim, max_len), (slots, kv_heads, max_len, head_dim)

    def cache_write(self, k_c, v_c, k, v, positions):
        b = jnp.arange(k.shape[0])[:, None]
        pos = jnp.clip(positions, 0, v_c.shape[self.v_seq_axis] - 1)
        k_c = k_c.at[b, :, :, pos].set(k.astype(k_c.dtype))  # index [B,T] + slices K, H -> value [B,T,K,H]
        v_c = v_c.at[b, :, pos].set(v.astype(v_c.dtype))
        return k_c, v_c

    def attend_cached(self, q, k_c, v_c, mask, cfg):
        if q.shape[1] == 1:
            return attend_one_query(q, k_c.astype(q.dtype), v_c.astype(q.dtype), mask, cfg)
        return attend_queries(q, k_c.astype(q.dtype), v_c.astype(q.dtype), mask, cfg)

    def attend(self, q, k, v, mask, cfg, causal: bool = False):
        if mask is not None and cfg.attention_impl == "auto":
            return attend_uncached(q, k, v, mask, cfg, causal)
        if cfg.attn_logit_softcap is not None:
            return einsum_attention(q, k, v, mask, cfg)
        impl = None if cfg.attention_impl == "auto" else cfg.attention_impl
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=cfg.attn_scale, implementation=impl)

    def categorical(self, x, keys_fn):
        return sample_categorical(x, _uniform_rows(keys_fn))


_SETS = {"generic": GenericKernels(), "cpu": CpuKernels()}


# ---------------------------------------------------------------------- which compute dtypes the backend runs
def check_compute_dtype(dtype: str, key: str, kernels: str = "auto") -> None:
    """A one-line `ConfigError` naming `key` when this backend cannot run the kernel set's products and attention
    (forward and backward) in `dtype`; float32 always runs. Found once per (kernel set, dtype) by compiling
    and running one tiny program (`_cannot_run`), not by a table that could go stale."""
    if dtype == "float32":
        return
    problem = _cannot_run(resolve(kernels), dtype)
    if problem is not None:
        raise ConfigError(f"{key}={dtype}: the {_platform()} backend cannot compute in {dtype} with the "
                          f"{resolve(kernels)} kernels ({problem}); use float32 or bfloat16")


@functools.cache
def _cannot_run(kernels: str, dtype: str) -> str | None:
    """None when the products and attention of kernel set `kernels` run in `dtype` here, else the error's first
    line."""
    ks, d = _SETS[kernels], jnp.dtype(dtype)
    cfg = types.SimpleNamespace(attn_scale=1.0, attn_logit_softcap=None, attention_impl="auto")
    mask = jnp.tril(jnp.ones((8, 8), bool))[None, None]

    def probe(x, w):  # the dot algorithms of the cached calls are these (`half_dot_algorithms`)
        q = ks.contract(x, w, 1).reshape(1, 8, 2, 8)
        out = ks.attend(q, q, q, mask, cfg, causal=True)
        return jnp.sum(ks.contract(out.reshape(1, 8, 16), w, 1, jnp.float32))

    try:
        x, w = jnp.ones((1, 8, 16), d), jnp.ones((16, 16), d)
        jax.block_until_ready(jax.jit(jax.value_and_grad(probe, argnums=(0, 1)))(x, w))
    except Exception as e:  # noqa: BLE001 - the backend's refusal, reported as a config error
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return None
