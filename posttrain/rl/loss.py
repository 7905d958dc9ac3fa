"""The RL policy loss in the trainer's protocol: `loss_fn(model, batch) -> (loss_sum, weight, metrics)`.

Per-token log-probs of the current policy come from one forward pass over prompt+completion, with the
vocabulary projection only at completion positions (and chunked, so [tokens, vocab] logits are never
whole; see `posttrain.rl.batch` for the layout); the loss itself is
`posttrain.algorithms.policy.policy_loss` (PPO/DAPO clipped ratio or GSPO, KL to the reference).
The minibatch loss L is returned as (L * w, w) with w the aggregation's weight (`Aggregation.weight`: target
tokens for token-mean, sequences otherwise; those the batch's rollout correction left, `RLBatch.is_weight`), so
summing over micro-batches and dividing reproduces the aggregate over the whole minibatch. Token entropy is computed in the same chunked pass, as a metric only.
A packed batch (`posttrain.rl.packing`) runs the forward over its rows and projects only its loss tokens; its
per-token fields, read per sequence slot, go through the same `policy_loss`.

A mixture of experts adds its router terms (`posttrain.models.moe_loss.RouterLoss`: load-balancing and z-losses,
the moe/* metrics) from the routing of the same forward pass. Routing replay: a batch whose `routed_experts` field
([rows, columns, L_sparse, k] int, aligned with input_ids; negative = not recorded) is set routes every token to
the recorded experts (`posttrain.models.moe`), and `moe/router_agreement` reports how often the trainer's own
router chose the same experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posttrain.algorithms.correction import masked_tokens
from posttrain.algorithms.policy import Aggregation, policy_loss
from posttrain.algorithms.sft import (
    images_in_order,
    logprobs_and_entropy,
    real_tokens,
    routes_experts,
    with_router_terms,
)
from posttrain.models.moe_loss import RouterLoss
from posttrain.rl.batch import RLBatch
from posttrain.rl.packing import PackedRLBatch


def _logp_and_entropy(model, h, targets, chunk_size: int | None):
    """log p(targets) and the entropy of softmax(logits) per position, chunked over tokens."""
    b, s, d = h.shape
    n = b * s

    def piece(hc, tc):
        return logprobs_and_entropy(model.logits(hc[None])[0], tc)

    if not chunk_size or chunk_size >= n:
        tgt, ent = piece(h.reshape(n, d), targets.reshape(n))
        return tgt.reshape(b, s), ent.reshape(b, s)
    n_chunks = -(-n // chunk_size)
    pad = n_chunks * chunk_size - n
    hf = jnp.pad(h.reshape(n, d), ((0, pad), (0, 0))).reshape(n_chunks, chunk_size, d)
    tf = jnp.pad(targets.reshape(n), (0, pad)).reshape(n_chunks, chunk_size)
    tgt, ent = jax.lax.map(jax.checkpoint(lambda a: piece(*a)), (hf, tf))
    return tgt.reshape(-1)[:n].reshape(b, s), ent.reshape(-1)[:n].reshape(b, s)


def routed_experts(batch):
    """The batch's recorded experts for routing replay ([rows, columns, L_sparse, k]), None when it has none."""
    return getattr(batch, "routed_experts", None)


def padded_logprobs(model, batch: RLBatch, chunk_size: int | None = None, *, routing: bool = False, replay=None):
    """(log-probs, entropies) [N, C] of a padded batch's completion tokens under `model` (an image batch's
    `pixel_values` to the model in placeholder order); with `routing` the pass's `moe.Routing` third;
    `replay`: recorded experts to route to (a mixture of experts)."""
    c = batch.completion_len  # completions fill the last C columns; column P-1+j predicts completion token j
    ids = batch.input_ids
    extra = {} if batch.pixel_values is None else {"pixel_values": images_in_order(batch.pixel_values, ids, model)}
    h, _, *rest = model.hidden_states(ids, attention_mask=batch.attention_mask, positions=batch.positions,
                                      routing=routing, replay=replay, **extra)
    return (*_logp_and_entropy(model, h[:, -c - 1:-1], ids[:, -c:], chunk_size), *rest)


def packed_logprobs(model, batch: PackedRLBatch, chunk_size: int | None = None, *, routing: bool = False,
                    replay=None):
    """(log-probs, entropies) [R*S, C] of a packed batch's slots (`posttrain.rl.packing`): one forward over the
    rows (segments kept apart; a shared prompt seen by its row's completions), the vocabulary projected at the
    [R, M] compact tokens only, placed in their slots (0 where nothing was projected). `routing`, `replay`: as
    `padded_logprobs`."""
    ids, src = batch.input_ids, batch.token_src
    extra = {} if batch.pixel_values is None else {"pixel_values": images_in_order(batch.pixel_values, ids, model)}
    h, _, *rest = model.hidden_states(ids, attention_mask=batch.attention_mask, positions=batch.positions,
                                      segment_ids=batch.segment_ids, routing=routing, replay=replay, **extra)
    hs = jnp.take_along_axis(h, src[..., None], axis=1)  # [R, M, D]: the states that predict the tokens
    logp, ent = _logp_and_entropy(model, hs, batch.token_tgt, chunk_size)
    r, s, c = batch.loss_mask.shape
    rows = jnp.arange(r)[:, None]

    def place(x):
        return jnp.zeros((r, s * c), x.dtype).at[rows, batch.token_dst].set(x, mode="drop").reshape(r * s, c)

    return (place(logp), place(ent), *rest)


_PER_SEQUENCE = ("loss_mask", "advantages", "behaviour_logp", "old_logp", "ref_logp", "is_weight")


def _per_sequence(batch):
    """The per-token fields as padded per-sequence arrays, and N for Dr. GRPO (None: the rows)."""
    if isinstance(batch, PackedRLBatch):
        return {k: batch.by_sequence(k) for k in _PER_SEQUENCE}, jnp.sum(batch.seq_valid)
    return {k: getattr(batch, k) for k in _PER_SEQUENCE}, None


def rl_loss(model, batch: RLBatch | PackedRLBatch, *, loss_kwargs: dict, chunk_size: int | None = None,
            router: RouterLoss | None = None):
    """Policy loss of one (micro-)batch (an `RLBatch`: `posttrain.rl.batch.build_rl_batch`, its old log-probs
    set by the learner; or the same packed, `posttrain.rl.packing.PackedRLBatch`); a mixture of experts adds its
    router terms (`router`) and replays the batch's `routed_experts` when it has them (module docstring)."""
    packed = isinstance(batch, PackedRLBatch)
    moe = routes_experts(model)
    replay = routed_experts(batch) if moe else None
    logp, ent, *routing = (packed_logprobs if packed else padded_logprobs)(model, batch, chunk_size, routing=moe,
                                                                           replay=replay)
    f, n_seq = _per_sequence(batch)
    old = f["behaviour_logp"] if f["old_logp"] is None else f["old_logp"]
    loss, metrics = policy_loss(logp, old, f["advantages"], f["loss_mask"], ref_logp=f["ref_logp"],
                                is_weights=f["is_weight"], num_sequences=n_seq, **loss_kwargs)
    # the minibatch's weight counts what the loss counted: tokens and sequences left by the rollout correction
    kept, n_kept = masked_tokens(f["loss_mask"], f["is_weight"], n_seq)
    w = Aggregation.of(loss_kwargs.get("aggregation", Aggregation.TOKEN_MEAN)).weight(kept, n_kept)
    mask = f["loss_mask"]
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    # (numerator, denominator) pairs: the trainer reports Σ num / Σ den over micro-batches
    out = {k: (v * w, w) for k, v in metrics.items()}
    out["entropy"] = (jnp.sum(ent * mask), tokens)
    loss_sum = loss * w
    if moe:
        real = real_tokens(batch.input_ids, batch.attention_mask)
        loss_sum, out = with_router_terms(router, model, routing[0], real, loss_sum, w, out, replay)
    return loss_sum, w, out


def make_rl_loss(loss_kwargs: dict, chunk_size: int | None = None, router: RouterLoss | None = None):
    """`rl_loss` bound to the keyword arguments of `policy_loss` (the preset's), the vocabulary chunk size and a
    mixture of experts' router terms; a batch's rollout correction comes with it (`RLBatch.is_weight`)."""
    return functools.partial(rl_loss, loss_kwargs=dict(loss_kwargs), chunk_size=chunk_size, router=router)
