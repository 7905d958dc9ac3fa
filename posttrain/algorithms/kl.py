"""Per-token KL-divergence estimators (k1, k2, k3) between the policy and a reference model.

John Schulman, "Approximating KL divergence" (2020), http://joschu.net/blog/kl-approx.html.
With samples drawn from the policy and ``log_r = ref_logp - logp``:

* ``k1 = logp - ref_logp = -log_r``                 (unbiased, high variance, can be negative)
* ``k2 = 0.5 * (logp - ref_logp) ** 2``             (biased, low variance, >= 0)
* ``k3 = exp(log_r) - log_r - 1``                   (unbiased, low variance, >= 0; used by GRPO)
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["kl_k1", "kl_k2", "kl_k3", "kl_penalty", "KL_KINDS"]


def kl_k1(logp, ref_logp):
    """k1 estimator: ``logp - ref_logp``."""
    return jnp.asarray(logp, jnp.float32) - jnp.asarray(ref_logp, jnp.float32)


def kl_k2(logp, ref_logp):
    """k2 estimator: ``0.5 * (logp - ref_logp)**2``."""
    d = jnp.asarray(logp, jnp.float32) - jnp.asarray(ref_logp, jnp.float32)
    return 0.5 * d * d


def kl_k3(logp, ref_logp):
    """k3 estimator: ``exp(ref_logp - logp) - (ref_logp - logp) - 1``."""
    log_r = jnp.asarray(ref_logp, jnp.float32) - jnp.asarray(logp, jnp.float32)
    return jnp.exp(log_r) - log_r - 1.0


KL_KINDS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(logp, ref_logp, kind: str = "k3"):
    """Per-token KL(policy || reference) estimate of shape ``logp.shape`` (float32).

    ``kind`` is one of ``"k1"``, ``"k2"``, ``"k3"`` (see module docstring for formulas).
    """
    try:
        fn = KL_KINDS[kind]
    except KeyError:
        raise ValueError(
            f"unknown KL estimator {kind!r}; accepted: {sorted(KL_KINDS)}"
        ) from None
    return fn(logp, ref_logp)
