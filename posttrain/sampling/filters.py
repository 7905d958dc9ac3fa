"""Token choice inside compiled code: temperature, top-k / top-p / min-p filtering, sampling and log-probs.

Everything works on float32 logits [rows, vocab]. Filters set removed tokens to -inf. What changes the
program is static: the k of top-k (`lax.top_k` needs it) and whether top-p is on at all (its sort and cumulative
sum over the vocabulary are among the costliest parts to compile); temperature, the top_p value and min_p are
traced, so changing them reuses the compiled program. Greedy-or-not is traced too (`lax.cond` picks the argmax
or the sampling code at run time), so a run that decodes greedily (evaluation) and by sampling (rollouts)
compiles one program, not two (issue 40's budget); a greedy-only program (a Python bool) holds no sampling code
and compiled in 0.58 s instead of 1.02 s on the benchmark model, and gives the same tokens and log-probs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.algorithms.sft import logprobs_from_logits
from posttrain.models import kernels as kernels_lib


def filter_logits(x: jax.Array, top_k: int, top_p: jax.Array, min_p: jax.Array, *, nucleus: bool = True) -> jax.Array:
    """Applies top-k (static k, 0 = off), then top-p, then min-p to (temperature-scaled) logits x [R, V].

    Removed tokens become -inf. Ties at a cut-off are kept (every token whose logit equals the k-th
    largest stays, and so on). nucleus=False (static) leaves top-p out of the program (top_p must then be
    1); with it, top_p >= 1 still skips the sort at run time (`lax.cond`); min_p = 0 keeps all.
    """
    neg = jnp.asarray(-jnp.inf, x.dtype)
    if 0 < top_k < x.shape[-1]:
        ordered, _ = jax.lax.top_k(x, top_k)  # [R, k], descending
        x = jnp.where(x >= ordered[:, -1:], x, neg)
    else:
        ordered = None

    def top_p_filter(x):
        srt = ordered if ordered is not None else -jnp.sort(-x, axis=-1)
        p = jax.nn.softmax(srt, axis=-1)
        mass_before = jnp.cumsum(p, axis=-1) - p
        count = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # >= 1: the top token is always kept
        cutoff = jnp.take_along_axis(srt, count - 1, axis=-1)
        return jnp.where(x >= cutoff, x, neg)

    if nucleus:
        x = jax.lax.cond(top_p < 1.0, top_p_filter, lambda x: x, x)
    # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p)  (the softmax normaliser cancels; log 0 = -inf)
    x_max = jnp.max(x, axis=-1, keepdims=True)
    return jnp.where(x >= x_max + jnp.log(min_p), x, neg)


def first_argmax(x: jax.Array) -> jax.Array:
    """argmax over the last axis (first index of the maximum) as two plain reductions: max, then the smallest
    index holding it. Same result as `jnp.argmax` on finite rows; on CPU several times faster than its
    variadic (value, index) reduction."""
    m = jnp.max(x, axis=-1)
    idx = jnp.where(x == m[:, None], jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1])
    return jnp.minimum(jnp.min(idx, axis=-1), x.shape[-1] - 1).astype(jnp.int32)


def choose_tokens(logits: jax.Array, keys, top_k: int, greedy, temperature, top_p, min_p, *,
                  nucleus: bool = True, kernels="auto"):
    """Picks one token per row of float32 logits [R, V].

    keys: a function returning typed PRNG keys [R] (one per row; only called when sampling).
    greedy takes the argmax of the raw logits: a Python bool (static: the other code is not traced) or a traced
    scalar bool (both codes compiled, `lax.cond` runs one).
    nucleus (static): whether top-p may be on (see `filter_logits`).
    Sampling draws exactly from softmax(filtered logits / temperature) with the kernel set's sampler
    (`kernels`: a name or a `ModelConfig`; `posttrain.models.kernels`: Gumbel-max for generic, an
    inverse CDF at one uniform number per row for cpu). Returns (tokens [R] int32, logprobs [R] under
    log_softmax(logits), sampling_logprobs [R] under the filtered, temperature-scaled distribution;
    0 when greedy).
    """
    logits = logits.astype(jnp.float32)

    def argmax(logits, _):
        tok = first_argmax(logits)  # its max is merged by XLA with the log-prob's own
        return tok, logprobs_from_logits(logits, tok), jnp.zeros(tok.shape, jnp.float32)

    def sample(logits, scaled):
        x = filter_logits(scaled, top_k, top_p, min_p, nucleus=nucleus)
        tok, lse = kernels_lib.get(kernels).categorical(x, keys)
        slp = jnp.take_along_axis(x, tok[:, None], axis=-1)[:, 0] - lse
        return tok, logprobs_from_logits(logits, tok), slp

    if isinstance(greedy, bool):
        return (argmax if greedy else sample)(logits, logits / temperature)
    # the temperature's division stays outside the branches: inside, XLA rounded it differently (sampling log-probs
    # differed from the static program's in the last bit); outside, both programs give the same bits
    return jax.lax.cond(greedy, argmax, sample, logits, logits / temperature)
