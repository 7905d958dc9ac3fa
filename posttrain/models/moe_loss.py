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

`RouterLoss` is what a training loss (SFT, DPO, RL: `posttrain.algorithms`) adds for a mixture of experts from the
`moe.Routing` of its own forward pass: aux_coef * load-balancing loss + z_coef * z-loss, and the metrics
`moe/aux_loss`, `moe/z_loss`, `moe/load_max`, `moe/router_entropy` (and `moe/router_agreement` under routing
replay). A batch without real tokens gives zeros, not NaN.
"""

from __future__ import annotations

import dataclasses

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
    rows = probs.shape[0] * jnp.maximum(jnp.sum(weight), 1.0)
    return num_experts * jnp.sum((counts / rows) * (prob_sums / rows))


def router_z_loss(router_logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """ST-MoE's router z-loss (Zoph et al. 2022, arXiv:2202.08906, eq. 5): the mean over tokens (and layers) of
    logsumexp(router logits)^2, which keeps the logits small. router_logits [L, N, E], mask [N]; float32 scalar."""
    z = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1) ** 2  # [L, N]
    weight = jnp.ones(z.shape[1], jnp.float32) if mask is None else mask.reshape(-1).astype(jnp.float32)
    return jnp.sum(z * weight) / (z.shape[0] * jnp.maximum(jnp.sum(weight), 1.0))


def router_stats(router_logits: jax.Array, top_k: int, mask: jax.Array | None = None) -> dict[str, jax.Array]:
    """`load_max`: the largest fraction of the (real) tokens that one expert receives, over layers and experts (1/E *
    k when balanced, at most 1); `entropy`: the mean entropy (nats) of the router's softmax per token and layer."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [L, N, E]
    weight = jnp.ones(probs.shape[1], jnp.float32) if mask is None else mask.reshape(-1).astype(jnp.float32)
    _, chosen = jax.lax.top_k(probs, top_k)
    load = jnp.einsum("lnke,n->le", jax.nn.one_hot(chosen, probs.shape[-1], dtype=jnp.float32), weight)
    entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)  # [L, N]
    tokens = jnp.maximum(jnp.sum(weight), 1.0)
    return {"load_max": jnp.max(load) / tokens, "entropy": jnp.sum(entropy * weight) / (entropy.shape[0] * tokens)}


def router_agreement(current: jax.Array, replayed: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """The fraction of (real token, sparse layer) choices where the current router's top-k set `current` equals the
    replayed set `replayed` (both ids [..., L, k], order within k ignored); `mask` [...] (1 real token). Choices
    with a negative replayed id (nothing recorded) are left out; float32 scalar (0 when none is left)."""
    a = jnp.sort(current.astype(jnp.int32), axis=-1)
    b = jnp.sort(replayed.astype(jnp.int32), axis=-1)
    same = jnp.all(a == b, axis=-1).astype(jnp.float32)  # [..., L]
    weight = jnp.all(b >= 0, axis=-1).astype(jnp.float32)
    if mask is not None:
        weight = weight * mask.astype(jnp.float32)[..., None]
    return jnp.sum(same * weight) / jnp.maximum(jnp.sum(weight), 1.0)


@dataclasses.dataclass(frozen=True)
class RouterLoss:
    """The router terms of a training loss (module docstring); hashable, so a loss holding it keys compile caches.

    aux_loss_coef: weight of the load-balancing loss; None = the checkpoint's `router_aux_loss_coef` (transformers
      adds it only with `output_router_logits=True`; here it is on whenever the checkpoint gives a weight), 0 = off.
    z_loss_coef: weight of the router z-loss (0 = off; ST-MoE used 1e-3).
    """

    aux_loss_coef: float | None = None
    z_loss_coef: float = 0.0

    def __call__(self, cfg, routing, mask: jax.Array | None = None, replay: jax.Array | None = None):
        """(penalty to add to the loss (a float32 scalar with gradients into the routers), metrics {name: scalar})
        for model config `cfg`, a forward pass's `moe.Routing`, its token mask [B, T] (1 real) and the replayed ids
        [B, T, L_sparse, k] when routing was replayed."""
        coef = cfg.router_aux_loss_coef if self.aux_loss_coef is None else self.aux_loss_coef
        flat = None if mask is None else mask.reshape(-1)
        k = cfg.num_experts_per_tok
        aux = load_balancing_loss(routing.logits, k, flat)
        z = router_z_loss(routing.logits, flat)
        stats = router_stats(routing.logits, k, flat)
        metrics = {"moe/aux_loss": aux, "moe/z_loss": z, "moe/load_max": stats["load_max"],
                   "moe/router_entropy": stats["entropy"]}
        if replay is not None:
            metrics["moe/router_agreement"] = router_agreement(routing.experts, replay, mask)
        penalty = float(coef) * aux + float(self.z_loss_coef) * z
        return penalty, {name: jax.lax.stop_gradient(v) for name, v in metrics.items()}
