"""Router losses and statistics of a mixture of experts: the load-balancing loss as transformers 5.23 computes it
(`load_balancing_loss_func` of Mixtral, Qwen2-MoE and Qwen3-MoE; weighted by `router_aux_loss_coef` there), the
router z-loss, and the load and entropy statistics a training run logs.

Switch Transformer (Fedus, Zoph & Shazeer 2021, arXiv:2101.03961, eqs. 4-6): with E experts, f_i the fraction of
(token, top-k slot) assignments that go to expert i and P_i the mean router probability of expert i,

    loss = E * sum_i f_i * P_i,

smallest (= k, transformers counts all k choices, so sum_i f_i = k) when routing is uniform. As in transformers, the
counts and probabilities are pooled over all sparse layers before the product (f_i = assignments to i over all
layers / (layers * real tokens)), padding tokens (mask 0) are left out, and the probabilities are the softmax of
each layer's router logits. The top-k choice has no gradient: the loss trains the router through P_i only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def load_balancing_loss(router_logits: jax.Array, top_k: int, mask: jax.Array | None = None) -> jax.Array:
    """The auxiliary loss (module docstring) of router logits [L, N, E] (L sparse layers, N tokens) and an optional
    token mask [N] (1 real, 0 padding); a float32 scalar."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [L, N, E]
    num_experts = probs.shape[-1]
    _, chosen = jax.lax.top_k(probs, top_k)  # [L, N, k]
    weight = jnp.ones(probs.shape[1], jnp.float32) if mask is None else mask.reshape(-1).astype(jnp.float32)
    counts = jnp.einsum("lnke,n->e", jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32), weight)
    prob_sums = jnp.einsum("lne,n->e", probs, weight)
    rows = probs.shape[0] * jnp.sum(weight)
    return num_experts * jnp.sum((counts / rows) * (prob_sums / rows))


def router_z_loss(router_logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """ST-MoE's router z-loss (Zoph et al. 2022, arXiv:2202.08906, eq. 5): the mean over tokens (and layers) of
    logsumexp(router logits)^2, which keeps the logits small. router_logits [L, N, E], mask [N]; float32 scalar."""
    z = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1) ** 2  # [L, N]
    weight = jnp.ones(z.shape[1], jnp.float32) if mask is None else mask.reshape(-1).astype(jnp.float32)
    return jnp.sum(z * weight) / (z.shape[0] * jnp.sum(weight))


def router_stats(router_logits: jax.Array, top_k: int, mask: jax.Array | None = None) -> dict[str, jax.Array]:
    """`load_max`: the largest fraction of the (real) tokens that one expert receives, over layers and experts (1/E *
    k when balanced, at most 1); `entropy`: the mean entropy (nats) of the router's softmax per token and layer."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [L, N, E]
    weight = jnp.ones(probs.shape[1], jnp.float32) if mask is None else mask.reshape(-1).astype(jnp.float32)
    _, chosen = jax.lax.top_k(probs, top_k)
    load = jnp.einsum("lnke,n->le", jax.nn.one_hot(chosen, probs.shape[-1], dtype=jnp.float32), weight)
    entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)  # [L, N]
    tokens = jnp.sum(weight)
    return {"load_max": jnp.max(load) / tokens, "entropy": jnp.sum(entropy * weight) / (entropy.shape[0] * tokens)}
