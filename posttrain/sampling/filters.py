"""Token choice inside compiled code: temperature, top-k / top-p / min-p filtering, sampling and log-probs.

Everything works on float32 logits [rows, vocab]. Filters set removed tokens to -inf. What changes the
program is static: the k of top-k (`lax.top_k` needs it) and whether top-p is on at all (its sort and cumulative
sum over the vocabulary are among the costliest parts to compile); temperature, the top_p value and min_p are
traced, so changing them reuses the compiled program. Greedy-or-not is traced too (`lax.cond` picks the argmax
or the sampling code at run time), so a run that decodes greedily (evaluation) and by sampling (rollouts)
compiles one program, not two (issue 40's budget); a greedy-only program (a Python bool) holds no sampling code
and compiled in 0.58 s instead of 1.02 s on the benchmark model, and gives the same tokens and log-probs.

Per-row parameters (`RowSampling`, the server's batches: every slot its own request): temperature, top-k, top-p,
min-p and greedy-or-not are arrays [R], all traced, so one program serves every mix of requests. The per-row top-k
and top-p need the sorted logits; that sort runs only when some row asks for either (`lax.cond`), and the sampling
code only when some row samples. A greedy row gets the argmax and the log-prob `choose_tokens` gives it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from posttrain.algorithms.sft import logprobs_from_logits
from posttrain.models import kernels as kernels_lib

__all__ = ["RowSampling", "choose_tokens", "choose_tokens_rows", "filter_logits", "filter_rows", "first_argmax",
           "top_logprobs"]


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Sampling parameters per row (one slot's request each), every field an array [R]: `greedy` (bool: argmax of
    the raw logits, the other fields ignored), `temperature` (float32 > 0), `top_k` (int32, 0 = off), `top_p`
    (float32 in (0, 1], 1 = off), `min_p` (float32 in [0, 1), 0 = off), `logprobs` (bool: the row wants its
    top log-probs, `top_logprobs`) and `ignore_stop` (bool: the row's sequence does not end at a stop token)."""

    greedy: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    logprobs: jax.Array
    ignore_stop: jax.Array

    def take(self, idx) -> RowSampling:
        """The parameters of rows `idx` (clipped into range)."""
        return jax.tree.map(lambda a: jnp.take(a, idx, axis=0, mode="clip"), self)


def filter_rows(x: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """`filter_logits` with per-row parameters [R] (top_k 0 = off, top_p 1 = off, min_p 0 = off): top-k, then
    top-p over what top-k kept, then min-p, on (temperature-scaled) logits x [R, V]. Ties at a cut-off are kept.
    The sort over the vocabulary runs only when some row has top-k or top-p on."""
    v = x.shape[-1]
    neg = jnp.asarray(-jnp.inf, x.dtype)
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)

    def sorted_filter(x):
        srt = -jnp.sort(-x, axis=-1)  # [R, V] descending
        kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
        x = jnp.where(x >= kth, x, neg)
        srt = jnp.where(jnp.arange(v)[None, :] < k[:, None], srt, neg)
        p = jax.nn.softmax(srt, axis=-1)
        mass_before = jnp.cumsum(p, axis=-1) - p
        count = jnp.sum(mass_before < top_p[:, None], axis=-1, keepdims=True)  # >= 1: the top token is kept
        cutoff = jnp.take_along_axis(srt, count - 1, axis=-1)
        cutoff = jnp.where(top_p[:, None] < 1.0, cutoff, neg)  # rounding never cuts a row without top-p
        return jnp.where(x >= cutoff, x, neg)

    x = jax.lax.cond(jnp.any(k < v) | jnp.any(top_p < 1.0), sorted_filter, lambda x: x, x)
    x_max = jnp.max(x, axis=-1, keepdims=True)
    return jnp.where(x >= x_max + jnp.log(min_p)[:, None], x, neg)


def choose_tokens_rows(logits: jax.Array, keys, rows: RowSampling, *, kernels="auto"):
    """`choose_tokens` with parameters per row (`RowSampling`): one token per row of float32 logits [R, V].

    A greedy row takes the argmax of the raw logits; a sampling row draws from softmax(filtered logits /
    temperature) with the kernel set's sampler (keys() -> typed PRNG keys [R], called only when some row samples).
    Returns (tokens [R] int32, logprobs [R] under log_softmax(logits), sampling_logprobs [R] under the row's
    sampling distribution; 0 for greedy rows)."""
    logits = logits.astype(jnp.float32)
    arg = first_argmax(logits)

    def sample(logits):
        temperature = jnp.where(rows.greedy, 1.0, rows.temperature).astype(jnp.float32)
        x = filter_rows(logits / temperature[:, None], rows.top_k, rows.top_p, rows.min_p)
        tok, lse = kernels_lib.get(kernels).categorical(x, keys)
        return tok, jnp.take_along_axis(x, tok[:, None], axis=-1)[:, 0] - lse

    def greedy(logits):
        return arg, jnp.zeros(arg.shape, jnp.float32)

    tok, slp = jax.lax.cond(jnp.all(rows.greedy), greedy, sample, logits)
    tok = jnp.where(rows.greedy, arg, tok)
    slp = jnp.where(rows.greedy, 0.0, slp)
    return tok, logprobs_from_logits(logits, tok), slp


def top_logprobs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k most likely tokens of each row of logits [R, V] and their log-probs under log_softmax(logits) (float32;
    the same distribution as the chosen tokens' log-probs): (ids [R, k] int32, log-probs [R, k]), most likely
    first; ties in index order."""
    logits = logits.astype(jnp.float32)
    m = jnp.max(logits, axis=-1, keepdims=True)  # the normaliser as `logprobs_from_logits` computes it
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1, keepdims=True)) + m
    values, ids = jax.lax.top_k(logits, k)
    return ids.astype(jnp.int32), values - lse
