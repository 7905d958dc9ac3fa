"""Expert parallelism: a mixture of experts' expert compute on a mesh with an `expert` axis, in one `jax.shard_map`.

Layout (`posttrain.distributed`'s rules): the stacked expert weights gate/up [E, D, F] and down [E, F, D] are split
by expert over `expert` (E/ep experts per device along it), D over `fsdp` and F over `tensor` as a dense MLP's
are; the tokens [B, T, D] are split by row over the batch axes (data, fsdp, expert). Per device:

1. tokens in: when the rows are split over `expert`, each device all-gathers the rows of its expert group (and
   their routing), so that every token of the group meets every expert shard;
2. weights: the fsdp shards of its experts' D are all-gathered (FSDP's gather; the backward reduce-scatters);
3. compute: the kernel set's expert compute (`posttrain.models.expert_kernels`: grouped or dense) over its E/ep
   local experts; a token's (token, expert) pairs with experts held elsewhere get the out-of-range id E/ep, which
   both kernels drop, and weight 0;
4. outputs back: the partial outputs are summed over `tensor` (each device holds an F slice, so down's products
   are partial sums) and reduce-scattered over `expert` to the device's own rows (psum_scatter); when the rows
   are not split over `expert` (a batch it does not divide) every device of the axis holds them all: no gather,
   and the partial outputs are summed (psum).

Per layer this moves the group's tokens in (an all-gather of ep x the local rows) and the outputs back (a
reduce-scatter): Megatron-LM's "allgather" token dispatcher. An all-to-all sending each token to the shards of its
k experts only moves less when ep > k, at the price of capacity limits or ragged buffers. Results equal the
unsharded computation up to float summation order (tests/test_moe_sharding.py: logits and gradients to 1e-5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from posttrain import distributed

EXPERT_AXIS = "expert"


def applies(mesh: Mesh | None) -> bool:
    """Whether the expert compute runs expert-parallel: a mesh whose `expert` axis has more than one device."""
    return mesh is not None and mesh.shape.get(EXPERT_AXIS, 1) > 1


def _axes(spec: PartitionSpec, dim: int) -> tuple[str, ...]:
    """The mesh axes that split dimension `dim` under `spec` (() when it is replicated)."""
    entry = spec[dim] if dim < len(spec) else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _full(spec: PartitionSpec, ndim: int) -> PartitionSpec:
    return PartitionSpec(*[spec[i] if i < len(spec) else None for i in range(ndim)])


def experts(compute, x, gate, up, down, top_idx, top_w, act: str, mesh: Mesh):
    """`compute(x [N, D], gate, up, down, top_idx [N, k], top_w [N, k], act) -> [N, D]` (the kernel set's expert
    compute) run expert-parallel over `mesh` (module docstring) on tokens x [B, ..., D] with their routing
    top_idx / top_w [B, ..., k]; returns [B, ..., D]."""
    lead = x.ndim - 1
    x_spec = _full(distributed.logical_to_spec(("batch",) + (None,) * lead, x.shape, mesh), x.ndim)
    r_spec = PartitionSpec(*x_spec[:lead], None)
    g_spec = _full(distributed.logical_to_spec(("expert", "embed", "mlp"), gate.shape, mesh), 3)
    d_spec = _full(distributed.logical_to_spec(("expert", "mlp", "embed"), down.shape, mesh), 3)
    split_experts = EXPERT_AXIS in _axes(g_spec, 0)
    gather = split_experts and EXPERT_AXIS in _axes(x_spec, 0)
    local_experts = gate.shape[0] // (mesh.shape[EXPERT_AXIS] if split_experts else 1)
    embed_axes, mlp_axes = _axes(g_spec, 1), _axes(g_spec, 2)
    if _axes(d_spec, 1) != mlp_axes or _axes(d_spec, 2) != embed_axes:  # one rule for both: never seen
        raise ValueError(f"expert weights sharded inconsistently: gate/up {g_spec}, down {d_spec}")

    def local(x, idx, w, g, u, d):
        if gather:
            x, idx, w = (jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True) for a in (x, idx, w))
        if embed_axes:
            g, u = (jax.lax.all_gather(a, embed_axes, axis=1, tiled=True) for a in (g, u))
            d = jax.lax.all_gather(d, embed_axes, axis=2, tiled=True)
        if split_experts:
            mine = idx - jax.lax.axis_index(EXPERT_AXIS) * local_experts
            held = (mine >= 0) & (mine < local_experts)
            idx, w = jnp.where(held, mine, local_experts), jnp.where(held, w, 0.0)
        k = idx.shape[-1]
        y = compute(x.reshape(-1, x.shape[-1]), g, u, d, idx.reshape(-1, k), w.reshape(-1, k), act).reshape(x.shape)
        if mlp_axes:
            y = jax.lax.psum(y, mlp_axes)
        if gather:
            return jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, EXPERT_AXIS) if split_experts else y

    run = jax.shard_map(local, mesh=mesh, in_specs=(x_spec, r_spec, r_spec, g_spec, g_spec, d_spec),
                        out_specs=x_spec)
    return run(x, top_idx, top_w, gate, up, down)
