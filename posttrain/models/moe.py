"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE): a router, `num_experts` gated MLPs, dropless top-k.

Routing is computed as transformers 5.23 computes it (`Qwen3MoeTopKRouter`, `MixtralTopKRouter`,
`Qwen2MoeTopKRouter`): router logits x @ W_r in the compute dtype, softmax over the experts in float32, the top
`num_experts_per_tok` probabilities, renormalised to sum to 1 when `norm_topk_prob` (Mixtral: always). Every token
goes to all of its k experts (dropless: no capacity, no token dropped); the layer's output is
sum_j w_j * down_e(act(gate_e(x)) * up_e(x)) over the chosen experts e_j, plus, for Qwen2-MoE, a shared expert
(a dense gated MLP) times sigmoid(x @ w_shared_gate).

The expert compute itself is the kernel set's (`posttrain.models.kernels`, `experts`): grouped matmuls over the
token-expert pairs sorted by expert (`jax.lax.ragged_dot`) on accelerators, every token through every expert on
CPU (`posttrain.models.expert_kernels`). Expert weights are stored stacked over experts,
gate/up [E, D, F] and down [E, F, D], with logical axes ("expert", "embed", "mlp").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models import kernels as kernels_lib
from posttrain.models.config import ModelConfig
from posttrain.models.layers import MLP, Linear, dtype_of, param


def route(logits: jax.Array, k: int, renormalise: bool) -> tuple[jax.Array, jax.Array]:
    """(top-k gate weights [N, k] float32, expert ids [N, k] int32) from router logits [N, E]: softmax in
    float32, top k (largest first), optionally renormalised to sum to 1."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_w, top_idx = jax.lax.top_k(probs, k)
    if renormalise:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w, top_idx.astype(jnp.int32)


class Experts(nnx.Module):
    """`num_experts` gated MLPs stacked on a leading expert axis (normal(0, 1/sqrt(fan_in)) initialisation)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        pdtype = dtype_of(cfg.param_dtype)

        def init(shape, axes):
            w = jax.random.normal(rngs.params(), shape, pdtype) * (1.0 / math.sqrt(shape[1]))
            return param(w, axes)

        self.gate_proj = init((e, d, f), ("expert", "embed", "mlp"))
        self.up_proj = init((e, d, f), ("expert", "embed", "mlp"))
        self.down_proj = init((e, f, d), ("expert", "mlp", "embed"))
        self.act = cfg.hidden_act
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        self.kernels = kernels_lib.resolve(cfg.kernels)

    def __call__(self, x: jax.Array, top_idx: jax.Array, top_w: jax.Array) -> jax.Array:
        """x [N, D] -> [N, D]: each token through its k experts, weighted by top_w."""
        cd = self.compute_dtype
        ws = [w[...].astype(cd) for w in (self.gate_proj, self.up_proj, self.down_proj)]
        return kernels_lib.get(self.kernels).experts(x.astype(cd), *ws, top_idx, top_w, self.act)


class SparseMoE(nnx.Module):
    """Router (`gate`), `experts`, and for Qwen2-MoE the gated `shared_expert` (module docstring)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.gate = Linear((d,), (cfg.num_experts,), ("embed",), ("expert",), bias=False, cfg=cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, rngs, width=cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear((d,), (1,), ("embed",), (None,), bias=False, cfg=cfg, rngs=rngs)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.renormalise = cfg.norm_topk_prob

    def router(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(router logits [N, E], top-k weights [N, k] float32, expert ids [N, k]) of tokens x [N, D]."""
        logits = self.gate(x)
        top_w, top_idx = route(logits, self.top_k, self.renormalise)
        return logits, top_w, top_idx

    def __call__(self, x: jax.Array, with_logits: bool = False):
        """x [..., D] -> the layer's output [..., D] (and the router logits [N, E] with `with_logits`)."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        logits, top_w, top_idx = self.router(xf)
        y = self.experts(xf, top_idx, top_w)
        if self.shared_expert is not None:
            gate = jax.nn.sigmoid(self.shared_expert_gate(xf))
            y = y + (gate * self.shared_expert(xf)).astype(y.dtype)
        return (y.reshape(shape), logits) if with_logits else y.reshape(shape)
