"""The per-token losses a Tinker client names in `forward_backward` (`cross_entropy`, `importance_sampling`, `ppo`).

Each datum carries its own targets and loss inputs, aligned with its input tokens: position t of the input predicts
`target_tokens[t]` (the Tinker API's next-token alignment). `logp_t = log p_theta(target_tokens[t] | input[:t+1])`
is the learner's log-prob, `q_t` the sampler's (`loss_fn_inputs["logprobs"]`), `A_t` an advantage, `w_t` a weight.
Every loss is a *sum* over the tokens of every datum (no normalisation: a client scales with its weights or
advantages), so gradients of several `forward_backward` calls add up before one `optim_step`:

- cross_entropy (supervised):      L = sum_t  -w_t logp_t
- importance_sampling (REINFORCE with an importance ratio for the sampler/learner mismatch):
                                   L = sum_t  -exp(logp_t - q_t) A_t
- ppo (Schulman et al. 2017, arXiv:1707.06347, clipped per token):
                                   L = sum_t  -min(r_t A_t, clip(r_t, c_low, c_high) A_t),  r_t = exp(logp_t - q_t)
  with `c_low`, `c_high` from the request's `loss_fn_config` (`clip_low_threshold`, `clip_high_threshold`,
  default 0.8 and 1.2, i.e. epsilon 0.2 both ways).

`valid` marks the real positions of a padded batch: padded ones contribute nothing and their log-ratios are zeroed
before `exp` (so no inf reaches a gradient). All math in float32. `LOSSES` says what each loss reads.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from posttrain.algorithms.policy import clipped_surrogate

__all__ = ["LOSSES", "LossSpec", "cross_entropy", "importance_sampling", "ppo", "token_loss"]


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def cross_entropy(logp, weights, valid):
    """Per-token `-w_t logp_t` (0 off `valid`)."""
    return jnp.where(valid, -_f32(weights) * _f32(logp), 0.0)


def _ratio(logp, sampling_logp, valid):
    """`exp(logp_t - q_t)` on valid positions, 1 elsewhere (the log-ratio is zeroed before `exp`)."""
    return jnp.exp(jnp.where(valid, _f32(logp) - _f32(sampling_logp), 0.0))


def importance_sampling(logp, sampling_logp, advantages, valid):
    """Per-token `-exp(logp_t - q_t) A_t` (0 off `valid`)."""
    return jnp.where(valid, -_ratio(logp, sampling_logp, valid) * _f32(advantages), 0.0)


def ppo(logp, sampling_logp, advantages, valid, clip_low: float = 0.8, clip_high: float = 1.2):
    """Per-token `-min(r_t A_t, clip(r_t, clip_low, clip_high) A_t)` (0 off `valid`)."""
    ratio = _ratio(logp, sampling_logp, valid)
    per_token = clipped_surrogate(ratio, _f32(advantages), 1.0 - clip_low, clip_high - 1.0)
    return jnp.where(valid, per_token, 0.0)


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """What a named loss reads: float inputs (besides `target_tokens`) that must be given, ones that default to 1,
    and the `loss_fn_config` keys it accepts with their defaults."""

    required: tuple[str, ...] = ()
    optional_ones: tuple[str, ...] = ()
    config: tuple[tuple[str, float], ...] = ()


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(optional_ones=("weights",)),
    "importance_sampling": LossSpec(required=("logprobs", "advantages")),
    "ppo": LossSpec(required=("logprobs", "advantages"),
                    config=(("clip_low_threshold", 0.8), ("clip_high_threshold", 1.2))),
}


def token_loss(name: str, logp, inputs: dict, valid, config: tuple[tuple[str, float], ...] = ()):
    """Per-token losses [B, T] of the loss `name` over the learner's `logp` [B, T]; `inputs` holds the float
    inputs `LOSSES[name]` names, `config` its (key, value) settings (static)."""
    settings = dict(config)
    if name == "cross_entropy":
        return cross_entropy(logp, inputs["weights"], valid)
    if name == "importance_sampling":
        return importance_sampling(logp, inputs["logprobs"], inputs["advantages"], valid)
    if name == "ppo":
        return ppo(logp, inputs["logprobs"], inputs["advantages"], valid,
                   settings.get("clip_low_threshold", 0.8), settings.get("clip_high_threshold", 1.2))
    raise ValueError(f"unknown loss {name!r}; supported: {', '.join(LOSSES)}")
