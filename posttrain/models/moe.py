"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE): a router, `num_experts` gated MLPs, dropless top-k.

Routing is computed as transformers 5.23 computes it (`Qwen3MoeTopKRouter`, `MixtralTopKRouter`,
`Qwen2MoeTopKRouter`): router logits x @ W_r in the compute dtype, softmax over the experts in float32, the top
`num_experts_per_tok` probabilities, renormalised to sum to 1 when `norm_topk_prob` (Mixtral: always). Every token
goes to all of its k experts (dropless: no capacity, no token dropped); the layer's output is
sum_j w_j * down_e(act(gate_e(x)) * up_e(x)) over the chosen experts e_j, plus, for Qwen2-MoE, a shared expert
(a dense gated MLP) times sigmoid(x @ w_shared_gate).

The expert compute itself is the kernel set's (`posttrain.models.kernels`, `experts`): grouped matmuls over the
token-expert pairs sorted by expert (`jax.lax.ragged_dot`) on accelerators, every token through every expert on
CPU (`posttrain.models.expert_kernels`); on a mesh with an `expert` axis it runs expert-parallel
(`posttrain.models.expert_parallel`). Expert weights are stored stacked over experts, gate/up [E, D, F] and down
[E, F, D], with logical axes ("expert", "embed", "mlp"); LoRA adapters on them (`posttrain.models.lora`) are folded
into the weights of each call.

Routing replay (RL: train on the experts the sampler used): with `replay` ids [N, k] each token goes to the replayed
experts, weighted by the current router's softmax over all experts gathered at them (renormalised as the model
normally is), so the router still gets a gradient (top-k values alone would give it none at a different choice).
A token whose replayed ids hold a negative entry (nothing recorded) takes the router's own choice. Every call also
returns the router's own top-k ids (with or without replay): what a sampler records, and what agreement is
measured with (`posttrain.models.moe_loss.router_agreement`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx, struct

from posttrain.models import expert_parallel
from posttrain.models import kernels as kernels_lib
from posttrain.models.config import ModelConfig
from posttrain.models.layers import MLP, Linear, dtype_of, param

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


@struct.dataclass
class Routing:
    """The routing of one forward pass over its sparse layers (`Transformer.hidden_states(..., routing=True)`).

    logits: router logits [L_sparse, B*T, E] (compute dtype), what the router losses read (`moe_loss`).
    experts: the router's own top-k expert ids [B, T, L_sparse, k], largest probability first, int8 (up to 128
      experts) or int16 (`experts_dtype`): what a sampler records and replays (`replay=` of the same shape).
    """

    logits: jax.Array
    experts: jax.Array


def experts_dtype(num_experts: int):
    """The compact integer dtype of expert ids: int8 up to 128 experts, else int16."""
    return jnp.int8 if num_experts <= 128 else jnp.int16


def route(logits: jax.Array, k: int, renormalise: bool) -> tuple[jax.Array, jax.Array]:
    """(top-k gate weights [N, k] float32, expert ids [N, k] int32) from router logits [N, E]: softmax in
    float32, top k (largest first), optionally renormalised to sum to 1."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_w, top_idx = jax.lax.top_k(probs, k)
    if renormalise:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w, top_idx.astype(jnp.int32)


def replay_route(logits: jax.Array, replay: jax.Array, own_idx: jax.Array, renormalise: bool):
    """(gate weights [N, k] float32, expert ids [N, k] int32) for replayed ids [N, k]: the softmax of the current
    router logits [N, E] over all experts, gathered at the replayed ids (the router's own ids `own_idx` for a token
    with a negative replayed entry), renormalised when `renormalise`. Differentiable in the logits."""
    replay = replay.astype(jnp.int32)
    idx = jnp.where(jnp.any(replay < 0, axis=-1, keepdims=True), own_idx, replay)
    w = jnp.take_along_axis(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), idx, axis=-1)
    if renormalise:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w, idx


class ExpertAdapter(nnx.Module):
    """A LoRA adapter on one stacked expert weight [(L,) E, in, out]: A [(L,) E, in, r], B [(L,) E, r, out] (one
    pair per expert), delta = scale * A @ B (`posttrain.models.lora` attaches it)."""

    def __init__(self, a: nnx.Variable, b: nnx.Variable, scale: float):
        self.lora_a, self.lora_b = a, b
        self.scale = float(scale)
        self.enabled = True

    def delta(self, dtype) -> jax.Array:
        a, b = self.lora_a[...].astype(dtype), self.lora_b[...].astype(dtype)
        d = jnp.einsum("...ir,...ro->...io", a, b, preferred_element_type=jnp.float32)
        return (self.scale * d).astype(dtype)


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
        self.gate_proj_lora = self.up_proj_lora = self.down_proj_lora = None  # ExpertAdapter (LoRA)
        self.act = cfg.hidden_act
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        self.kernels = kernels_lib.resolve(cfg.kernels)

    def weights(self) -> list[jax.Array]:
        """gate, up, down in the compute dtype, with their LoRA deltas added when adapters are on."""
        cd = self.compute_dtype
        out = []
        for kind in EXPERT_WEIGHTS:
            w = getattr(self, kind)[...].astype(cd)
            adapter = getattr(self, kind + "_lora")
            out.append(w + adapter.delta(cd) if adapter is not None and adapter.enabled else w)
        return out

    def __call__(self, x: jax.Array, top_idx: jax.Array, top_w: jax.Array, mesh=None) -> jax.Array:
        """x [..., D] -> [..., D]: each token through its k experts (top_idx, top_w [..., k]), weighted by top_w;
        expert-parallel on a mesh with an `expert` axis."""
        compute = kernels_lib.get(self.kernels).experts
        x = x.astype(self.compute_dtype)
        if expert_parallel.applies(mesh):
            return expert_parallel.experts(compute, x, *self.weights(), top_idx, top_w, self.act, mesh)
        k = top_idx.shape[-1]
        y = compute(x.reshape(-1, x.shape[-1]), *self.weights(), top_idx.reshape(-1, k), top_w.reshape(-1, k),
                    self.act)
        return y.reshape(x.shape)


class SparseMoE(nnx.Module):
    """Router (`gate`), `experts`, and for Qwen2-MoE the gated `shared_expert` (module docstring)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        # the router's expert axis is "router" (replicated): each device routes its tokens over every expert
        self.gate = Linear((d,), (cfg.num_experts,), ("embed",), ("router",), bias=False, cfg=cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, rngs, width=cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear((d,), (1,), ("embed",), (None,), bias=False, cfg=cfg, rngs=rngs)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.renormalise = cfg.norm_topk_prob

    def router(self, x: jax.Array, replay: jax.Array | None = None):
        """(router logits [N, E], gate weights [N, k] float32, expert ids used [N, k], the router's own ids [N, k])
        of tokens x [N, D]; with `replay` [N, k] the replayed experts are used (module docstring)."""
        logits = self.gate(x)
        top_w, own = route(logits, self.top_k, self.renormalise)
        if replay is None:
            return logits, top_w, own, own
        w, idx = replay_route(logits, replay, own, self.renormalise)
        return logits, w, idx, own

    def __call__(self, x: jax.Array, replay: jax.Array | None = None, mesh=None):
        """x [B, T, D] -> (the layer's output [B, T, D], router logits [B*T, E], the router's own ids [B*T, k]).
        replay: expert ids [B*T, k] to route to instead (module docstring)."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        logits, top_w, top_idx, own = self.router(xf, replay)
        k = self.top_k
        y = self.experts(x, top_idx.reshape(*shape[:-1], k), top_w.reshape(*shape[:-1], k), mesh).reshape(-1, shape[-1])
        if self.shared_expert is not None:
            gate = jax.nn.sigmoid(self.shared_expert_gate(xf))
            y = y + (gate * self.shared_expert(xf)).astype(y.dtype)
        return y.reshape(shape), logits, own
