"""Rollout correction: importance weights and rejection for tokens sampled by a behaviour policy mu (the sampler:
other kernels, another precision, stale weights) and trained on with the proximal policy pi_old (the trainer's own
log-probs of the same tokens, recomputed before the update).

With ``log r_t = log pi_old(y_t) - log mu(y_t)`` on the loss tokens of a sequence y, a level turns the token
log-ratios into the ratio the correction acts on (Liu, Li, Fu et al. 2025, "When Speed Kills Stability: Demystifying
RL Collapse from the Training-Inference Mismatch"; verl's `rollout_correction`)::

    token:      rho_t = r_t                                   (one ratio per token)
    sequence:   rho_i = prod_t r_t     = exp(sum_t log r_t)   (one per sequence, on each of its tokens)
    geometric:  rho_i = (prod_t r_t)^(1/|y_i|) = exp(mean_t log r_t)   (length-normalised: a ratio near 1)

Importance sampling (`is_level`, `is_mode`) weighs each token's policy-gradient surrogate:

    truncate (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training";
              IMPALA's truncated rho, Espeholt et al. 2018):           w = min(rho, is_cap)
    mask     (MIS; IcePop, Ling Team 2025, "Every Step Evolves"; the masked IS of Liu et al. 2025):
                                                                        w = rho * 1[is_low <= rho <= is_cap]

Rejection (`rejection`, verl's `rollout_rs`) drops tokens or whole sequences whose ratio (at its own level) leaves
``[rejection_low, rejection_high]`` without reweighting the rest: ``w <- w * 1[low <= rho' <= high]``.

A token whose weight is 0 (masked or rejected) leaves the loss entirely: its surrogate leaves the numerator and it
leaves the denominator of every aggregation (`masked_tokens`): the token count of token-mean (5 tokens, 3 masked:
the mean is over 2, slime#657), its sequence's token count in seq-mean-token-mean, and a sequence that loses every
token leaves the sequence count of both seq-mean-token-mean and Dr. GRPO's constant ``N * max_tokens``. A truncated
weight is never 0 (log-ratios are clamped at +-20 before exp), so 0 means "out" and nothing else.

Which to use: token-TIS (the default) corrects a small precision mismatch with bounded variance; sequence-level
masked IS (Seq-MIS) is the unbiased choice when whole sequences drift; geometric rejection (tight bounds, e.g.
[0.999, 1.001]) drops sequences whose per-token mismatch is large regardless of their length
(docs/explanation/off-policy.md has the recipe table).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal

import jax
import jax.numpy as jnp

__all__ = ["ISLevel", "ISMode", "RolloutCorrection", "rollout_correction", "masked_tokens", "level_log_ratios",
           "MAX_LOG_RATIO"]

#: Log-ratios are clamped to this magnitude before exp(): a wildly off-policy token cannot overflow (exp(20) ~ 4.9e8,
#: far outside any cap), and a truncated weight stays > 0 (exp(-20) ~ 2e-9).
MAX_LOG_RATIO = 20.0


def _choose(kind, value, what: str):
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; accepted: {sorted(m.value for m in kind)}") from None


class ISLevel(enum.StrEnum):
    """What one importance ratio covers (`learner.is_level`, `learner.rejection`): none, a token, a sequence (the
    product of its token ratios), or a sequence's geometric mean (module docstring)."""

    NONE = "none"
    TOKEN = "token"
    SEQUENCE = "sequence"
    GEOMETRIC = "geometric"

    @classmethod
    def of(cls, level) -> "ISLevel":
        return _choose(cls, level, "importance-sampling level")

    @property
    def corrects(self) -> bool:
        """Whether this level computes a ratio at all (`none` does not)."""
        return self is not ISLevel.NONE


class ISMode(enum.StrEnum):
    """How an importance ratio becomes a weight (`learner.is_mode`): truncated at the cap (TIS) or masked outside
    [low, cap] (MIS / IcePop)."""

    TRUNCATE = "truncate"
    MASK = "mask"

    @classmethod
    def of(cls, mode) -> "ISMode":
        return _choose(cls, mode, "importance-sampling mode")


@dataclasses.dataclass
class RolloutCorrection:
    """The rollout correction's settings: one typed section, the one source of their defaults and checks. The RL
    config's `learner` section holds these keys (it extends this class); the learner computes the correction with
    `rollout_correction` once per batch, after recomputing the proximal log-probs (the trainer's own).

    is_level: the importance-sampling level: token (one ratio pi_old / pi_sampler per token), sequence (the product
      of a sequence's token ratios, on each of its tokens), geometric (their geometric mean), or none (no weights).
    is_mode: truncate (TIS: weight min(ratio, is_cap)) or mask (MIS / IcePop: weight ratio inside [is_low, is_cap],
      and a token or sequence outside it leaves the loss: its numerator and its denominator).
    is_cap: the ratio's upper bound: where it is truncated (truncate) or above which it is masked (mask).
    is_low: mask's lower bound (below it the token or sequence leaves the loss); None = 1 / is_cap.
    rejection: drop tokens (token) or whole sequences (sequence: the product of their token ratios; geometric: its
      geometric mean) whose ratio leaves [rejection_low, rejection_high], without reweighting the rest (verl's
      rollout_rs); none = off. Combines with any is_level.
    rejection_low, rejection_high: rejection's bounds; None = the level's default: high 2.0 for token and sequence,
      1.001 for geometric (a geometric mean sits near 1); low = 1 / high.
    """

    is_level: Literal["token", "sequence", "geometric", "none"] = "token"
    is_mode: Literal["truncate", "mask"] = "truncate"
    is_cap: float = 2.0
    is_low: float | None = None
    rejection: Literal["none", "token", "sequence", "geometric"] = "none"
    rejection_low: float | None = None
    rejection_high: float | None = None

    def __post_init__(self):
        ISLevel.of(self.is_level), ISMode.of(self.is_mode), ISLevel.of(self.rejection)
        if not self.is_cap > 0:
            raise ValueError(f"learner.is_cap must be > 0, found {self.is_cap}")
        if self.is_mode == ISMode.MASK and self.is_level == ISLevel.NONE:
            raise ValueError("learner.is_mode=mask needs an importance-sampling level (learner.is_level: token, "
                             "sequence or geometric); to drop tokens without weights use learner.rejection")
        if not 0 <= self.mask_bounds[0] < self.is_cap:
            raise ValueError(f"learner.is_low must be in [0, learner.is_cap={self.is_cap}), found {self.is_low}")
        if self.rejection != ISLevel.NONE:
            low, high = self.rejection_bounds
            if not 0 <= low < high:
                raise ValueError(f"learner.rejection_low ({low}) must be >= 0 and below learner.rejection_high "
                                 f"({high})")

    @property
    def active(self) -> bool:
        """Whether anything is corrected (weights or rejection): the proximal log-probs are then recomputed."""
        return ISLevel.of(self.is_level).corrects or ISLevel.of(self.rejection).corrects

    @property
    def mask_bounds(self) -> tuple[float, float]:
        """[low, high] of mask mode's ratio (`is_low`, default 1 / `is_cap`)."""
        return (1.0 / self.is_cap if self.is_low is None else self.is_low), self.is_cap

    @property
    def rejection_bounds(self) -> tuple[float, float]:
        """[low, high] of rejection's ratio (module docstring; defaults by level)."""
        high = self.rejection_high
        if high is None:
            high = 1.001 if self.rejection == ISLevel.GEOMETRIC else 2.0
        return (1.0 / high if self.rejection_low is None else self.rejection_low), high

    def settings(self) -> "RolloutCorrection":
        """These settings alone (a section extending this class: its other keys left out)."""
        return RolloutCorrection(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RolloutCorrection)})


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _masked_mean(x, m):
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def _k3(log_r):
    """``r - 1 - log r`` at r = exp(log_r), accurate where the two precisions nearly agree: in float32, r - 1 rounds to
    multiples of 2^-23 and the difference (~log_r^2 / 2, 1e-12 for log_r ~ 1e-6) would be lost; below |log_r| = 0.1
    the series log_r^2 (1/2 + log_r/6 + log_r^2/24 + log_r^3/120) (truncation below 3e-7 relative), above it
    expm1(log_r) - log_r (rounding below 2e-6 relative)."""
    small = jnp.abs(log_r) < 0.1
    series = log_r * log_r * (0.5 + log_r * (1.0 / 6.0 + log_r * (1.0 / 24.0 + log_r / 120.0)))
    return jnp.where(small, series, jnp.expm1(jnp.clip(log_r, -MAX_LOG_RATIO, MAX_LOG_RATIO)) - log_r)


def level_log_ratios(log_r, mask, level):
    """The log-ratio a `level` acts on, [N, T] (a sequence's on each of its tokens): token log r_t, sequence
    sum_t log r_t, geometric mean_t log r_t (masked tokens only; `log_r` is 0 elsewhere)."""
    level = ISLevel.of(level)
    if level == ISLevel.TOKEN:
        return log_r
    total = jnp.sum(log_r * mask, axis=-1, keepdims=True)
    if level == ISLevel.GEOMETRIC:
        total = total / jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
    return jnp.broadcast_to(total, log_r.shape)


def _within(log_rho, low: float, high: float):
    """1[low <= rho <= high], compared in log space (low 0: no lower bound)."""
    above = log_rho >= jnp.log(low) if low > 0 else jnp.ones(log_rho.shape, bool)
    return (above & (log_rho <= jnp.log(high))).astype(jnp.float32)


def _per_unit(x, mask, level):
    """(values, weights) of the units a level counts: tokens for token (and none), else sequences, each valued by
    the mean over its loss tokens (which all hold the sequence's value)."""
    if ISLevel.of(level) in (ISLevel.TOKEN, ISLevel.NONE):
        return x, mask
    n = jnp.sum(mask, axis=-1)
    return jnp.sum(x * mask, axis=-1) / jnp.maximum(n, 1.0), (n > 0).astype(jnp.float32)


def rollout_correction(old_logp, behaviour_logp, mask, corr: RolloutCorrection):
    """The rollout correction of one batch: ``(weights [N, T], metrics)``.

    ``weights`` multiply each token's surrogate (stop-gradient constants; 0 on padding and on masked or rejected
    tokens: `masked_tokens` takes those out of the loss); all ones on the loss tokens when only metrics are wanted
    (`corr` inactive). ``old_logp`` the proximal (trainer's) log-probs, ``behaviour_logp`` the sampler's, ``mask``
    the loss tokens, all [N, T].

    Metrics: ``mismatch_kl``: what it compares is the sampler's log-probs of the sampled tokens with the trainer's
    recomputed ones, KL(pi_sampler || pi_trainer) estimated with k3 per loss token, ``r - 1 - log r`` with
    r = pi_old / mu (Schulman 2020; computed so that float32 does not round a small mismatch to 0: `_k3`), averaged
    over the batch's loss tokens; ``is/ratio_min``, ``is/ratio_max``: the
    extreme ratios the correction acts on (its IS level's; the rejection level's without IS; per token without
    either), over loss tokens or sequences; ``is/weight_mean``: the mean weight over the tokens left in the loss;
    ``is/truncated_frac``: units whose ratio was cut at the cap (truncate); ``is/ess``: effective sample size
    fraction (sum w)^2 / (n sum w^2) over the IS level's units; ``is/masked_frac``: loss tokens taken out (mask
    mode and rejection); ``is/rejected_seq_frac``: sequences with loss tokens that lost every one.
    """
    m = _f32(mask)
    valid = m > 0
    log_r = jnp.where(valid, _f32(old_logp) - _f32(behaviour_logp), 0.0)
    metrics = {"mismatch_kl": _masked_mean(_k3(log_r), m)}
    level, rejection = ISLevel.of(corr.is_level), ISLevel.of(corr.rejection)
    w = jnp.ones_like(m)
    shown = level if level.corrects else rejection if rejection.corrects else ISLevel.TOKEN
    if level.corrects:
        log_rho = jnp.clip(level_log_ratios(log_r, m, level), -MAX_LOG_RATIO, MAX_LOG_RATIO)
        rho = jnp.exp(log_rho)
        if ISMode.of(corr.is_mode) == ISMode.TRUNCATE:
            w = jnp.minimum(rho, corr.is_cap)
            cut, unit = _per_unit((rho > corr.is_cap).astype(jnp.float32), m, level)
            metrics["is/truncated_frac"] = _masked_mean(cut, unit)
        else:
            w = rho * _within(log_rho, *corr.mask_bounds)
    if rejection.corrects:
        log_rs = jnp.clip(level_log_ratios(log_r, m, rejection), -MAX_LOG_RATIO, MAX_LOG_RATIO)
        w = w * _within(log_rs, *corr.rejection_bounds)
    w = w * m
    ratio, unit = _per_unit(jnp.exp(jnp.clip(level_log_ratios(log_r, m, shown), -MAX_LOG_RATIO,
                                             MAX_LOG_RATIO)), m, shown)
    big = jnp.finfo(jnp.float32).max
    metrics["is/ratio_min"] = jnp.min(jnp.where(unit > 0, ratio, big))
    metrics["is/ratio_max"] = jnp.max(jnp.where(unit > 0, ratio, 0.0))
    kept = (w > 0).astype(jnp.float32)
    metrics["is/weight_mean"] = _masked_mean(w, kept)
    if level.corrects:
        wu, unit = _per_unit(w, m, level)
        metrics["is/ess"] = jnp.sum(wu * unit) ** 2 / jnp.maximum(jnp.sum(unit) * jnp.sum(wu * wu * unit), 1e-12)
    metrics["is/masked_frac"] = _masked_mean(1.0 - kept, m)
    has = jnp.sum(m, axis=-1) > 0
    lost = has & (jnp.sum(kept, axis=-1) == 0)
    metrics["is/rejected_seq_frac"] = jnp.sum(lost) / jnp.maximum(jnp.sum(has), 1)
    return jax.lax.stop_gradient((w, metrics))


def masked_tokens(mask, is_weights=None, num_sequences=None):
    """``(mask', N')``: the loss tokens left after a rollout correction (those whose weight is > 0) and the sequence
    count of Dr. GRPO's constant without the sequences that lost every token (``num_sequences`` N, default the rows;
    None back when there are no weights). What every aggregation then reduces over (module docstring)."""
    if is_weights is None:
        return mask, num_sequences
    m = _f32(mask)
    kept = m * (jax.lax.stop_gradient(_f32(is_weights)) > 0)
    lost = (jnp.sum(m, axis=-1) > 0) & (jnp.sum(kept, axis=-1) == 0)
    n = jnp.asarray(m.shape[0] if num_sequences is None else num_sequences, jnp.float32)
    return kept, n - jnp.sum(lost)
