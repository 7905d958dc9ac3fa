"""The RL policy loss in the trainer's protocol: `loss_fn(model, batch) -> (loss_sum, weight, metrics)`.

Per-token log-probs of the current policy come from one forward pass over prompt+completion, with the
vocabulary projection only at completion positions (and chunked, so [tokens, vocab] logits are never
whole; see `posttrain.rl.batch` for the layout); the loss itself is
`posttrain.algorithms.policy.policy_loss` (PPO/DAPO clipped ratio or GSPO, KL to the reference).
The minibatch loss L is returned as (L * w, w) with w the aggregation's weight (`Aggregation.weight`: target
tokens for token-mean, sequences otherwise), so summing over micro-batches and dividing reproduces the
aggregate over the whole minibatch. Token entropy is computed in the same chunked pass, as a metric only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posttrain.algorithms.policy import Aggregation, policy_loss
from posttrain.algorithms.sft import logprobs_and_entropy
from posttrain.rl.batch import RLBatch


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


def rl_loss(model, batch: RLBatch, *, loss_kwargs: dict, chunk_size: int | None = None):
    """Policy loss of one (micro-)batch (an `RLBatch`: `posttrain.rl.batch.build_rl_batch`, its old log-probs
    set by the learner)."""
    mask = batch.loss_mask
    c = mask.shape[1]  # completions fill the last C columns; column P-1+j predicts completion token j
    ids = batch.input_ids
    h, _ = model.hidden_states(ids, attention_mask=batch.attention_mask, positions=batch.positions)
    logp, ent = _logp_and_entropy(model, h[:, -c - 1:-1], ids[:, -c:], chunk_size)
    loss, metrics = policy_loss(logp, batch.proximal_logp, batch.advantages, mask, ref_logp=batch.ref_logp,
                                behaviour_logp=batch.behaviour_logp, **loss_kwargs)
    w = Aggregation.of(loss_kwargs.get("aggregation", Aggregation.TOKEN_MEAN)).weight(mask)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    # (numerator, denominator) pairs: the trainer reports Σ num / Σ den over micro-batches
    out = {k: (v * w, w) for k, v in metrics.items()}
    out["entropy"] = (jnp.sum(ent * mask), tokens)
    return loss * w, w, out


def make_rl_loss(loss_kwargs: dict, chunk_size: int | None = None):
    """`rl_loss` bound to the keyword arguments of `policy_loss` (with `is_level`/`is_cap`: the learner's
    off-policy correction) and the vocabulary chunk size."""
    return functools.partial(rl_loss, loss_kwargs=dict(loss_kwargs), chunk_size=chunk_size)
