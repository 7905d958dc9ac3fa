"""Clipped policy-gradient losses (PPO/GRPO/DAPO token-level, GSPO sequence-level),
loss aggregation modes, and a masked token-entropy helper. The rollout correction's weights
(`posttrain.algorithms.correction`) come in as `is_weights`.

Shapes: token arrays are ``[N, T]`` (N sequences, T completion positions) with a float/bool
``mask`` ``[N, T]`` marking real completion tokens; ``advantages`` is ``[N]`` and is broadcast
over the tokens of its sequence, or ``[N, T]`` (one per token). All math is done in float32.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from posttrain.algorithms.correction import MAX_LOG_RATIO, masked_tokens
from posttrain.algorithms.kl import kl_penalty

__all__ = [
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
    "Aggregation",
    "AGGREGATION_MODES",
    "aggregate",
    "policy_loss",
    "clipped_surrogate",
    "entropy_from_logits",
]

def _f32(x):
    return jnp.asarray(x, dtype=jnp.float32)


def token_mean(per_token, mask, max_tokens=None, num_sequences=None):
    """DAPO token-level mean (Yu et al. 2025): ``sum(x * m) / sum(m)`` over the whole batch.

    Every token carries equal weight regardless of the length of its sequence. ``max_tokens``
    and ``num_sequences`` are ignored. Returns 0 when the mask is empty.
    """
    x, m = _f32(per_token), _f32(mask)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def seq_mean_token_mean(per_token, mask, max_tokens=None, num_sequences=None):
    """Original GRPO aggregation (Shao et al. 2024): mean over sequences of the per-sequence
    token mean, ``1/N' * sum_i [ sum_t x_it m_it / sum_t m_it ]``.

    Sequences whose mask is entirely zero (e.g. filtered overlong samples) are excluded from
    ``N'``; returns 0 when no sequence has a token. ``max_tokens`` and ``num_sequences`` are ignored.
    """
    x, m = _f32(per_token), _f32(mask)
    lengths = jnp.sum(m, axis=-1)
    per_seq = jnp.sum(x * m, axis=-1) / jnp.maximum(lengths, 1.0)
    valid = (lengths > 0).astype(jnp.float32)
    return jnp.sum(per_seq * valid) / jnp.maximum(jnp.sum(valid), 1.0)


def seq_mean_token_sum_norm(per_token, mask, max_tokens=None, num_sequences=None):
    """Dr. GRPO aggregation (Liu et al. 2025): ``sum(x * m) / (N * max_tokens)``.

    ``max_tokens`` is a constant independent of the sampled lengths (e.g. the generation
    budget ``max_new_tokens``), which removes GRPO's length bias. Defaults to ``T``.
    ``num_sequences`` is N when the rows are not all sequences (a packed batch's empty slots,
    `posttrain.rl.packing`); default: the rows.
    """
    x, m = _f32(per_token), _f32(mask)
    t = x.shape[-1]
    t = float(t if max_tokens is None else max_tokens)
    if num_sequences is not None:
        return jnp.sum(x * m) / (jnp.maximum(_f32(num_sequences), 1.0) * t)
    n = x.shape[0]
    denom = float(n) * t
    if denom <= 0:
        raise ValueError(f"seq_mean_token_sum_norm needs N*max_tokens > 0, got N={n}, max_tokens={max_tokens}")
    return jnp.sum(x * m) / denom


def _token_count(mask, num_sequences=None):
    return jnp.sum(mask)


def _sequences_with_tokens(mask, num_sequences=None):
    return jnp.sum(jnp.any(mask > 0, axis=-1).astype(jnp.float32))


def _sequence_count(mask, num_sequences=None):
    return jnp.asarray(mask.shape[0] if num_sequences is None else num_sequences, jnp.float32)


def _choose(kind, value, what: str):
    """`value` (a config string) as a member of the StrEnum `kind`; a ValueError lists the accepted values."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; accepted: {sorted(m.value for m in kind)}") from None


class Aggregation(enum.StrEnum):
    """How per-token losses reduce to a scalar (`algorithm.aggregation`); see `aggregate`.

    Each mode also has a weight: the normaliser of a minibatch (target tokens for ``token_mean``, sequences
    with a token for ``seq_mean_token_mean``, rows for ``seq_mean_token_sum_norm``), so that summing
    ``(L * w, w)`` over micro-batches and dividing reproduces the aggregate over the whole minibatch.
    """

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"

    @classmethod
    def of(cls, mode) -> "Aggregation":
        return _choose(cls, mode, "aggregation mode")

    def reduce(self, per_token, mask, max_tokens=None, num_sequences=None):
        return _AGGREGATIONS[self][0](per_token, mask, max_tokens=max_tokens, num_sequences=num_sequences)

    def weight(self, mask, num_sequences=None):
        return _AGGREGATIONS[self][1](mask, num_sequences)


# the one table of aggregation modes: mode -> (reduction, minibatch weight)
_AGGREGATIONS = {
    Aggregation.TOKEN_MEAN: (token_mean, _token_count),
    Aggregation.SEQ_MEAN_TOKEN_MEAN: (seq_mean_token_mean, _sequences_with_tokens),
    Aggregation.SEQ_MEAN_TOKEN_SUM_NORM: (seq_mean_token_sum_norm, _sequence_count),
}
AGGREGATION_MODES = {m.value: reduce for m, (reduce, _) in _AGGREGATIONS.items()}  # config string -> reduction


def aggregate(per_token, mask, mode: str = "token_mean", max_tokens=None, num_sequences=None):
    """Reduce a ``[N, T]`` per-token quantity to a scalar with one of ``AGGREGATION_MODES``:

    * ``token_mean``:              ``sum(x*m) / sum(m)``                        (DAPO)
    * ``seq_mean_token_mean``:     ``mean_i( sum_t x*m / sum_t m )``           (GRPO)
    * ``seq_mean_token_sum_norm``: ``sum(x*m) / (N * max_tokens)``             (Dr. GRPO)
    """
    return Aggregation.of(mode).reduce(per_token, mask, max_tokens=max_tokens, num_sequences=num_sequences)


def _masked_mean(x, m):
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


# ---------------------------------------------------------------------- the pieces of policy_loss
def _per_token_advantages(adv, shape, ratio_level: str):
    """``[N]`` advantages as ``[N, 1]`` (broadcast over tokens), or ``[N, T]`` per-token ones as they are."""
    if adv.shape == (shape[0],):
        return adv[:, None]
    if adv.shape == shape:  # per-token advantages (e.g. on-policy distillation)
        if ratio_level == "sequence":
            raise ValueError("per-token advantages [N, T] need ratio_level='token' (GSPO's ratio is per sequence)")
        return adv
    raise ValueError(f"advantages must have shape [N]={shape[0]} or [N, T]={tuple(shape)}, got {adv.shape}")


def _token_ratio(log_ratio, adv_t, m, epsilon_low: float, epsilon_high: float):
    """PPO's per-token ratio ``r_t = exp(logp_t - old_logp_t)`` and its clip statistics over tokens."""
    ratio = jnp.exp(log_ratio)
    ratio_val = jax.lax.stop_gradient(ratio)
    low_hit = (adv_t < 0) & (ratio_val < 1.0 - epsilon_low)
    high_hit = (adv_t > 0) & (ratio_val > 1.0 + epsilon_high)
    stats = (_masked_mean(low_hit.astype(jnp.float32), m), _masked_mean(high_hit.astype(jnp.float32), m),
             _masked_mean(ratio_val, m))
    return ratio, stats


def _sequence_ratio(log_ratio, logp, adv, m, epsilon_low: float, epsilon_high: float):
    """GSPO-token's ratio ``s_it = sg(s_i) * exp(logp_t - sg(logp_t))`` (value ``s_i``, the length-normalised
    sequence ratio; gradient ``s_i * grad logp_t``) and its clip statistics over sequences."""
    sg = jax.lax.stop_gradient
    valid_tok = m > 0
    lengths = jnp.sum(m, axis=-1)
    seq_log_ratio = jnp.sum(log_ratio * m, axis=-1) / jnp.maximum(lengths, 1.0)
    seq_ratio = jnp.exp(sg(seq_log_ratio))  # s_i, a constant
    safe_logp = jnp.where(valid_tok, logp, 0.0)  # keep padded garbage out of exp()
    ratio = seq_ratio[:, None] * jnp.exp(safe_logp - sg(safe_logp))
    ratio = jnp.where(valid_tok, ratio, 1.0)
    seq_valid = (lengths > 0).astype(jnp.float32)
    low_hit = (adv < 0) & (seq_ratio < 1.0 - epsilon_low)
    high_hit = (adv > 0) & (seq_ratio > 1.0 + epsilon_high)
    stats = (_masked_mean(low_hit.astype(jnp.float32), seq_valid),
             _masked_mean(high_hit.astype(jnp.float32), seq_valid), _masked_mean(seq_ratio, seq_valid))
    return ratio, stats


def clipped_surrogate(ratio, adv_t, epsilon_low: float, epsilon_high: float):
    """Per-token ``l_t = -min(r_t * A, clip(r_t, 1 - epsilon_low, 1 + epsilon_high) * A)``."""
    surr_unclipped = ratio * adv_t
    surr_clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv_t
    return -jnp.minimum(surr_unclipped, surr_clipped)


def _kl_tokens(logp, ref_logp, valid_tok, kl_estimator: str):
    """Per-token ``kl_penalty(logp, ref_logp, kl_estimator)`` (padding scored as 0 vs 0)."""
    ref_logp = jax.lax.stop_gradient(_f32(ref_logp))
    if ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp shape {ref_logp.shape} != logp shape {logp.shape}")
    return kl_penalty(jnp.where(valid_tok, logp, 0.0), jnp.where(valid_tok, ref_logp, 0.0), kl_estimator)


def policy_loss(logp, old_logp, advantages, mask, *, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                ratio_level: str = "token", aggregation: str = "token_mean", ref_logp=None, beta: float = 0.0,
                kl_estimator: str = "k3", max_tokens=None, is_weights=None, num_sequences=None):
    """Clipped surrogate policy loss (to be minimised) and metrics.

    Token level (``ratio_level="token"``) -- PPO (Schulman et al. 2017, "Proximal Policy
    Optimization Algorithms") as used by GRPO, with DAPO's decoupled "clip-higher" range
    (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale")::

        r_t  = exp(logp_t - old_logp_t)
        l_t  = -min(r_t * A_i, clip(r_t, 1 - epsilon_low, 1 + epsilon_high) * A_i)

    Sequence level (``ratio_level="sequence"``) -- GSPO (Zheng et al. 2025, "Group Sequence
    Policy Optimization") with the length-normalised sequence ratio::

        s_i  = exp( 1/|y_i| * sum_t (logp_t - old_logp_t) )

    in its GSPO-token form ``s_it = sg(s_i) * exp(logp_t - sg(logp_t))`` (value ``s_i``, gradient
    ``s_i * grad logp_t``), and ``l_t = -min(s_it * A_i, clip(s_it, 1-eps_low, 1+eps_high) * A_i)``.

    ``is_weights`` [N, T] (a rollout correction's, `posttrain.algorithms.correction.rollout_correction`: the
    sampler's tokens weighed by pi_old / pi_sampler, truncated or masked) multiply each token's surrogate; a token
    whose weight is 0 leaves the loss, numerator and denominator of the aggregation alike, and a sequence that
    loses every token leaves the sequence counts (`correction.masked_tokens`).

    If ``beta > 0`` a per-token KL penalty ``beta * kl_penalty(logp, ref_logp, kl_estimator)``
    is added to ``l_t`` (GRPO). The per-token losses are reduced with
    ``aggregate(l, mask, aggregation, max_tokens, num_sequences)`` (``num_sequences``: N for Dr. GRPO when
    some rows are not sequences, e.g. a packed batch's empty slots; default the rows).

    Args:
      logp, old_logp, ref_logp: ``[N, T]`` log-probs of the sampled tokens under the current,
        behaviour (sampling) and reference policies. ``old_logp``/``ref_logp``/``advantages``
        are treated as constants (stop-gradient).
      advantages: ``[N]`` per-sequence advantages, broadcast over tokens, or ``[N, T]`` per-token advantages
        (token-level ratio only): A_it replaces A_i in l_t, e.g. on-policy distillation's
        ``-(logp_student - logp_teacher)`` per token (``posttrain.distill.on_policy``).
      mask: ``[N, T]`` float or bool, 1 for completion tokens.

    Returns:
      ``(loss, metrics)`` where metrics holds scalars ``pg_loss``, ``clip_frac_low`` (fraction
      of masked tokens -- or of sequences for GSPO -- where the lower clip is active, i.e.
      ``A < 0`` and ratio ``< 1 - epsilon_low``), ``clip_frac_high`` (``A > 0`` and ratio
      ``> 1 + epsilon_high``), ``clip_fraction`` (their sum), ``ratio_mean`` and, when
      ``ref_logp`` is given, ``kl`` (masked token mean of the chosen estimator).
    """
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"unknown ratio_level {ratio_level!r}; accepted: ['sequence', 'token']")
    if beta and ref_logp is None:
        raise ValueError("beta > 0 requires ref_logp")
    sg = jax.lax.stop_gradient
    logp, old_logp, m = _f32(logp), sg(_f32(old_logp)), _f32(mask)
    if logp.ndim != 2 or logp.shape != old_logp.shape or logp.shape != m.shape:
        raise ValueError(
            f"logp, old_logp and mask must share shape [N, T]; got {logp.shape}, {old_logp.shape}, {m.shape}"
        )
    m, num_sequences = masked_tokens(m, is_weights, num_sequences)
    adv = sg(_f32(advantages))
    adv_t = _per_token_advantages(adv, logp.shape, ratio_level)
    valid_tok = m > 0
    log_ratio = jnp.clip(jnp.where(valid_tok, logp - old_logp, 0.0), -MAX_LOG_RATIO, MAX_LOG_RATIO)
    if ratio_level == "token":
        ratio, (clip_frac_low, clip_frac_high, ratio_mean) = _token_ratio(log_ratio, adv_t, m, epsilon_low,
                                                                          epsilon_high)
    else:
        ratio, (clip_frac_low, clip_frac_high, ratio_mean) = _sequence_ratio(log_ratio, logp, adv, m, epsilon_low,
                                                                             epsilon_high)
    per_token = clipped_surrogate(ratio, adv_t, epsilon_low, epsilon_high)
    if is_weights is not None:
        per_token = per_token * sg(_f32(is_weights))
    pg_loss = aggregate(per_token, m, aggregation, max_tokens=max_tokens, num_sequences=num_sequences)
    metrics = {"pg_loss": sg(pg_loss), "clip_frac_low": clip_frac_low, "clip_frac_high": clip_frac_high,
               "clip_fraction": clip_frac_low + clip_frac_high, "ratio_mean": ratio_mean}
    loss = pg_loss
    if ref_logp is not None:
        kl_tok = _kl_tokens(logp, ref_logp, valid_tok, kl_estimator)
        metrics["kl"] = sg(_masked_mean(kl_tok, m))
        if beta:
            loss = aggregate(per_token + beta * kl_tok, m, aggregation, max_tokens=max_tokens,
                             num_sequences=num_sequences)
    return loss, metrics


def entropy_from_logits(logits, mask):
    """Masked mean token entropy ``H = -sum_v p_v log p_v`` of ``softmax(logits)``.

    ``logits`` ``[N, T, V]`` (cast to float32), ``mask`` ``[N, T]``. Returns a scalar; 0 for an
    empty mask.
    """
    logits = _f32(logits)
    logp = jax.nn.log_softmax(logits, axis=-1)
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return _masked_mean(ent, _f32(mask))
