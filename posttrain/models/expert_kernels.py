"""Expert compute of a mixture-of-experts layer, two ways with equal results: grouped (`jax.lax.ragged_dot`) and dense.

Both take the tokens x [N, D], the gated MLPs' weights gate/up [E, D, F] and down [E, F, D], and the routing
(`top_idx` [N, k] expert ids, `top_w` [N, k] float32 gate weights), and return
sum_j top_w[n, j] * down_e(act(gate_e(x_n)) * up_e(x_n)) for e = top_idx[n, j], in x's dtype. An id equal to E (out
of range) drops its pair: expert parallelism (`posttrain.models.expert_parallel`) marks so the pairs whose expert
another device holds.

- `grouped`: the N*k (token, expert) pairs sorted by expert, three grouped matmuls over the sorted rows
  (`jax.lax.ragged_dot`, one group per expert), unsorted and summed over k. Work proportional to k; what an
  accelerator wants (MaxText's and Tunix's dropless MoE do the same sort).
- `dense`: every token through every expert, combined by the [N, E] routing matrix (zero off the top k). E/k
  times the work, no sort or gather: cheaper on CPU while E/k is small (see `posttrain.models.kernels`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def activation(name: str):
    """The gated MLP's activation (silu, or tanh-approximate gelu)."""
    return jax.nn.silu if name == "silu" else (lambda g: jax.nn.gelu(g, approximate=True))


def routing_matrix(top_idx: jax.Array, top_w: jax.Array, num_experts: int) -> jax.Array:
    """[N, E] float32 gate weights: top_w at the chosen experts, zero elsewhere."""
    onehot = jax.nn.one_hot(top_idx, num_experts, dtype=jnp.float32)  # [N, k, E]
    return jnp.einsum("nk,nke->ne", top_w.astype(jnp.float32), onehot)


def dense(x, gate, up, down, top_idx, top_w, act: str = "silu"):
    """Every token through every expert, weighted by the routing matrix (see the module docstring)."""
    f = activation(act)
    h = f(jnp.einsum("nd,edf->enf", x, gate)) * jnp.einsum("nd,edf->enf", x, up)
    y = jnp.einsum("enf,efd->end", h, down)  # [E, N, D]
    w = routing_matrix(top_idx, top_w, gate.shape[0])
    return jnp.einsum("ne,end->nd", w.astype(y.dtype), y, preferred_element_type=jnp.float32).astype(x.dtype)


def grouped(x, gate, up, down, top_idx, top_w, act: str = "silu"):
    """Token-expert pairs sorted by expert through `jax.lax.ragged_dot` (see the module docstring)."""
    n, k = top_idx.shape
    e = gate.shape[0]
    flat = top_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair j*: token order[j] // k, expert flat[order[j]]
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)  # [N*k, D]
    f = activation(act)
    h = f(jax.lax.ragged_dot(xs, gate, sizes)) * jax.lax.ragged_dot(xs, up, sizes)
    ys = jax.lax.ragged_dot(h.astype(x.dtype), down, sizes)  # [N*k, D]
    ys = jnp.where((jnp.take(flat, order) < e)[:, None], ys, 0)  # dropped pairs (id E) sort last, outside the groups
    y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True).reshape(n, k, -1)  # back to (token, slot)
    return jnp.einsum("nk,nkd->nd", top_w.astype(y.dtype), y, preferred_element_type=jnp.float32).astype(x.dtype)


IMPLEMENTATIONS = {"grouped": grouped, "dense": dense}
