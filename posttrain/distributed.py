"""Device meshes and the one table of logical-axis rules that maps parameter and activation axes onto them.

Mesh axes: `data` (pure data parallelism), `fsdp` (data parallelism with parameters sharded, ZeRO-3
style) and `tensor` (Megatron-style tensor parallelism). Every parameter carries logical axis
names (flax's `out_sharding` metadata); `LOGICAL_RULES` turns each logical name into a mesh axis (or None = replicated).
Meshes are built with Auto axis types (sharding propagated by the compiler), stated explicitly since
`jax.make_mesh` defaults to Explicit axes in recent JAX.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis (or tuple of axes, or None). First match wins; a mesh axis is used once per array.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "act_embed": None,
    "layers": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "lora_rank": None,
}


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes; one size may be -1 (= the remaining devices)."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis size may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not divide into mesh sizes {sizes}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices, have {len(devices)}")
    arr = np.asarray(devices).reshape(sizes)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(logical_axes: Sequence[str | None] | None, shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None, rules=None) -> PartitionSpec:
    """PartitionSpec for logical axis names; an axis whose size the mesh axis does not divide stays replicated."""
    rules = LOGICAL_RULES if rules is None else rules
    if not logical_axes:
        return PartitionSpec()
    used: set[str] = set()
    out = []
    for i, name in enumerate(logical_axes):
        target = rules.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and (mesh is None or mesh.shape.get(a, 1) > 1))
        if axes and shape is not None and mesh is not None:
            size = int(np.prod([mesh.shape[a] for a in axes]))
            if shape[i] % size:
                axes = ()
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def sharding_for(variable: nnx.Variable, mesh: Mesh) -> NamedSharding:
    axes = getattr(variable, "out_sharding", None)
    return NamedSharding(mesh, logical_to_spec(axes, variable[...].shape, mesh))


def sharding_for_axes(variable: nnx.Variable, shape, mesh: Mesh | None) -> NamedSharding | None:
    """NamedSharding of a parameter of `shape` on `mesh` by its logical axes (None without a mesh)."""
    if mesh is None:
        return None
    return NamedSharding(mesh, logical_to_spec(getattr(variable, "out_sharding", None), shape, mesh))


def state_shardings(state: nnx.State, mesh: Mesh):
    """A pytree of NamedShardings matching an `nnx.State` of Variables (or their abstract shapes)."""
    return jax.tree.map(
        lambda v: NamedSharding(mesh, logical_to_spec(getattr(v, "out_sharding", None), v[...].shape, mesh)),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Places every parameter of `model` by its logical axes on `mesh` (in place) and returns the model."""
    state = nnx.state(model)
    shardings = state_shardings(state, mesh)
    values = jax.tree.map(lambda v: v[...], state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    placed = jax.device_put(values, jax.tree.map(lambda s: s, shardings, is_leaf=lambda x: isinstance(x, NamedSharding)))
    nnx.update(model, placed)
    model.mesh = mesh
    return model


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding for a [batch, ...] input array: batch over (data, fsdp), the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), None, mesh))


def constrain(x: jax.Array, logical_axes: Sequence[str | None], mesh: Mesh | None) -> jax.Array:
    """`with_sharding_constraint` by logical names when a mesh is in use; identity otherwise."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical_axes, x.shape, mesh)))
