"""Supervised fine-tuning loss: masked next-token cross-entropy (plain and chunked) and per-token log-probs.

Shift convention (as in `posttrain.data.formats`): position t predicts `input_ids[:, t + 1]`, and that
prediction is weighted by `loss_mask[:, t + 1]`. Losses come back as `(sum, count)` so the trainer can
normalise over the real target tokens of a whole accumulated batch (see `posttrain.training.trainer`).

A mixture of experts' loss adds its router terms (`posttrain.models.moe_loss.RouterLoss`: load-balancing loss,
z-loss, the moe/* metrics) from the routing of the same forward pass (`with_router_terms`).

The chunked path never materialises the [tokens, vocab] logits: the flattened hidden states are cut into
chunks of `chunk_size` tokens and `lax.map` computes, per chunk, `logits = model.logits(h_chunk)` (which
applies Gemma's final soft-capping and an LM-head adapter if any), its logsumexp and the target logit.
The chunk body is rematerialised (`jax.checkpoint`), so the backward pass keeps only one chunk of
logits alive at a time, not one per chunk.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models.moe_loss import RouterLoss

__all__ = [
    "routes_experts",
    "cross_entropy",
    "images_in_order",
    "logprobs_from_logits",
    "logprobs_from_hidden",
    "logprobs_and_entropy",
    "token_logprobs",
    "sft_loss",
    "make_sft_loss",
    "sft_weight",
    "real_tokens",
    "with_router_terms",
]


def logprobs_from_logits(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log softmax(logits)[target] in float32; logits [..., V], targets [...] int.

    Its gradient w.r.t. the logits is g * (onehot(target) - softmax(logits)), written as one elementwise
    pass (`_logprob_entropy`'s backward) instead of autodiff's zero-filled [.., V] scatter plus a separate
    softmax term. (The unused entropy is dropped by XLA's dead-code elimination.)
    """
    return logprobs_and_entropy(logits, targets)[0]


def logprobs_and_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log softmax(logits)[target], entropy of softmax(logits)) in float32 from one pass over the logits.

    The entropy H = -Σ p log p = lse - Σ p x is a metric: it carries no gradient (its cotangent is
    ignored); the log-prob's gradient is g * (onehot(target) - softmax(logits)).
    """
    return _logprob_entropy(logits.astype(jnp.float32), targets.astype(jnp.int32))


def _logprob_entropy_fwd(logits, targets):
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - m)
    s = jnp.sum(e, axis=-1)
    lse = jnp.log(s) + m[..., 0]
    ent = lse - jnp.sum(e * logits, axis=-1) / s
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - lse
    return (tgt, ent), (logits, targets, lse)


def _logprob_entropy_bwd(res, cts):
    logits, targets, lse = res
    onehot = jnp.arange(logits.shape[-1], dtype=jnp.int32) == targets[..., None]
    dlogits = cts[0][..., None] * (onehot.astype(jnp.float32) - jnp.exp(logits - lse[..., None]))
    return dlogits, np.zeros(targets.shape, jax.dtypes.float0)


@jax.custom_vjp
def _logprob_entropy(logits, targets):
    return _logprob_entropy_fwd(logits, targets)[0]


_logprob_entropy.defvjp(_logprob_entropy_fwd, _logprob_entropy_bwd)


def cross_entropy(logits: jax.Array, input_ids: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Plain masked next-token cross-entropy over full logits.

    logits [B, T, V] (position t scores token t+1), input_ids [B, T], loss_mask [B, T].
    Returns (Σ_t mask[t+1] * -log p(ids[t+1] | ..t), Σ_t mask[t+1]).
    """
    targets = input_ids[:, 1:]
    w = loss_mask[:, 1:].astype(jnp.float32)
    nll = -logprobs_from_logits(logits[:, :-1], targets)
    return jnp.sum(nll * w), jnp.sum(w)


def logprobs_from_hidden(model, h: jax.Array, targets: jax.Array, *, chunk_size: int | None = None) -> jax.Array:
    """log p(targets) from final hidden states h [B, S, D] and targets [B, S] via `model.logits`.

    With `chunk_size` (tokens per chunk) smaller than B*S the vocabulary projection runs chunk by chunk
    under `lax.map` with a rematerialised body; otherwise in one piece.
    """
    b, s, d = h.shape
    n = b * s
    if not chunk_size or chunk_size >= n:
        return logprobs_from_logits(model.logits(h), targets)
    n_chunks = -(-n // chunk_size)
    pad = n_chunks * chunk_size - n
    hf = jnp.pad(h.reshape(n, d), ((0, pad), (0, 0))).reshape(n_chunks, chunk_size, d)
    tf = jnp.pad(targets.reshape(n), (0, pad)).reshape(n_chunks, chunk_size)

    @jax.checkpoint
    def chunk(args):
        hc, tc = args
        return logprobs_from_logits(model.logits(hc[None])[0], tc)

    out = jax.lax.map(chunk, (hf, tf))
    return out.reshape(-1)[:n].reshape(b, s)


def routes_experts(model) -> bool:
    """Whether `model` is a mixture of experts (its forward can return its routing). A model without a `cfg`
    (any object with `hidden_states` and `logits`, as the losses take) is not."""
    cfg = getattr(model, "cfg", None)
    return bool(getattr(cfg, "is_moe", False))


def images_in_order(pixel_values: jax.Array, input_ids: jax.Array, model) -> jax.Array:
    """A batch's images [B, M, C, H, W] (row r's images first, zeros after them) -> [B*M, C, H, W] with the real
    images first, in the order of their placeholder tokens (row by row), padding images after them: the order in
    which a vision-language model fills its placeholders. A row's image count is its placeholders / tokens per
    image."""
    vc = model.cfg.vision
    b, m = pixel_values.shape[:2]
    n = jnp.sum(input_ids == vc.image_token_id, axis=1) // vc.mm_tokens_per_image
    padding = (jnp.arange(m)[None, :] >= n[:, None]).reshape(-1)
    order = jnp.argsort(padding, stable=True)
    return pixel_values.reshape(b * m, *pixel_values.shape[2:])[order]


def token_logprobs(model, input_ids: jax.Array, *, attention_mask=None, positions=None, segment_ids=None,
                   chunk_size: int | None = None, last: int | None = None, pixel_values=None, replay=None,
                   routing: bool = False):
    """Per-token log-probs [B, T-1]: entry t is log p(input_ids[:, t+1] | input_ids[:, :t+1]).

    With `last` = C, only the log-probs of the last C tokens, [B, C] (entry j about input_ids[:, T-C+j]):
    the vocabulary is projected at those C positions only (RL's completion columns, `posttrain.rl.batch`).
    This is what RL needs for the current, behaviour and reference policies; padding positions hold
    meaningless values and must be masked by the caller.
    pixel_values: a vision-language batch's images [B, M, C, H, W] (`images_in_order`); None for text.
    A mixture of experts: `replay` [B, T, L_sparse, k] routes to recorded experts (`posttrain.models.moe`);
    `routing=True` returns (log-probs, the pass's `moe.Routing`).
    """
    extra = {} if pixel_values is None else {"pixel_values": images_in_order(pixel_values, input_ids, model)}
    if replay is not None:
        extra["replay"] = replay
    h, _, *rest = model.hidden_states(input_ids, attention_mask=attention_mask, positions=positions,
                                      segment_ids=segment_ids, routing=routing, **extra)
    t = input_ids.shape[1]
    if last is not None and not 0 < last < t:
        raise ValueError(f"last={last} must be in [1, {t - 1}] for sequences of {t} tokens")
    start = 0 if last is None else t - 1 - last
    logp = logprobs_from_hidden(model, h[:, start:-1], input_ids[:, start + 1:], chunk_size=chunk_size)
    return (logp, rest[0]) if routing else logp


def real_tokens(input_ids, attention_mask=None, segment_ids=None) -> jax.Array:
    """[B, T] float32, 1 on the tokens the model reads as real (what the router losses average over, as transformers
    does with the attention mask): `attention_mask`, else `segment_ids != 0` (packed rows), else every token."""
    if attention_mask is not None:
        return jnp.asarray(attention_mask).astype(jnp.float32)
    if segment_ids is not None:
        return (jnp.asarray(segment_ids) != 0).astype(jnp.float32)
    return jnp.ones(jnp.shape(input_ids), jnp.float32)


def with_router_terms(router: RouterLoss | None, model, routing, mask, loss_sum, weight, metrics: dict,
                      replay=None):
    """(loss_sum + penalty * weight, metrics with the moe/* entries as (value * weight, weight) pairs): a mixture of
    experts' router terms (`router`; None: `RouterLoss()`, the checkpoint's load-balancing weight) over its
    `routing`, weighted like the loss (so that the trainer's Σ loss_sum / Σ weight adds the weight-averaged
    penalty)."""
    penalty, extra = (router or RouterLoss())(model.cfg, routing, mask, replay)
    w = jnp.asarray(weight, jnp.float32)
    return loss_sum + penalty * w, {**metrics, **{k: (v * w, w) for k, v in extra.items()}}


def sft_weight(batch: dict[str, Any]) -> jax.Array:
    """The normaliser of the SFT loss: the number of target tokens, Σ loss_mask[:, 1:]."""
    return jnp.sum(jnp.asarray(batch["loss_mask"])[:, 1:].astype(jnp.float32))


def sft_loss(model, batch: dict[str, jax.Array], *, chunk_size: int | None = None,
             router: RouterLoss | None = None):
    """The trainer's loss protocol for SFT: (Σ masked token NLL, Σ mask, metrics).

    `batch` holds input_ids, loss_mask and optionally attention_mask, positions, segment_ids ([B, T]) and, for
    a vision-language model, pixel_values [B, M, C, H, W] (`posttrain.data.pipeline`).
    Metrics follow the trainer's convention: a scalar is summed over micro-batches. A mixture of experts adds its
    router terms (`router`, `with_router_terms`).
    """
    ids = batch["input_ids"]
    moe = routes_experts(model)
    out = token_logprobs(model, ids, attention_mask=batch.get("attention_mask"), positions=batch.get("positions"),
                         segment_ids=batch.get("segment_ids"), chunk_size=chunk_size,
                         pixel_values=batch.get("pixel_values"), routing=moe)
    logp, routing = out if moe else (out, None)
    w = batch["loss_mask"][:, 1:].astype(jnp.float32)
    loss_sum = -jnp.sum(logp * w)
    count = jnp.sum(w)
    metrics = {"target_tokens": count}
    if moe:
        mask = real_tokens(ids, batch.get("attention_mask"), batch.get("segment_ids"))
        loss_sum, metrics = with_router_terms(router, model, routing, mask, loss_sum, count, metrics)
    return loss_sum, count, metrics


def make_sft_loss(chunk_size: int | None = None, router: RouterLoss | None = None):
    """`sft_loss` with a fixed chunk size and router terms (a hashable callable for the trainer's compile cache)."""
    return functools.partial(sft_loss, chunk_size=chunk_size or None, router=router)
