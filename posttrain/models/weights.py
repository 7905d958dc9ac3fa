"""Weights as a flat `{path: array}` dict: what a trainer publishes and what samplers load.

A path is the variable's attribute path joined by "/" (e.g. `layers/mlp/down_proj/lora_a`), the same for
an `nnx.State` split off a model and for the model itself, so a dict taken from a trainer's trained
parameters (all of them, or only the LoRA adapters) can be loaded into any model of the same structure,
in another process or on another host. Values are copied on the way in and out: a sampler never holds a
reference to a trainer's (donated) buffers.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["flat_weights", "load_flat_weights", "to_host", "nbytes", "path_names"]


def path_names(path) -> list[str]:
    """Plain names of a jax key path (dict keys, attribute names, sequence indices)."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
    return out


def _key(path) -> str:
    return "/".join(n for n in path_names(path) if n != "value")


def flat_weights(state) -> dict[str, jax.Array]:
    """The array leaves of an `nnx.State` (or any pytree of Variables/arrays) keyed by their paths."""
    return {_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def to_host(flat: Mapping[str, jax.Array], dtype=None) -> dict[str, np.ndarray]:
    """Numpy copies (gathered from every device); floating arrays cast to `dtype` when given (e.g. bfloat16
    to halve a transfer)."""
    out = {}
    for k, x in flat.items():
        a = np.asarray(jax.device_get(x))
        if dtype is not None and jnp.issubdtype(a.dtype, jnp.floating):
            a = a.astype(dtype)
        out[k] = a
    return out


def nbytes(flat: Mapping[str, np.ndarray]) -> int:
    return int(sum(np.asarray(x).nbytes for x in flat.values()))


def load_flat_weights(model: nnx.Module, flat: Mapping[str, jax.Array | np.ndarray]) -> int:
    """Copies `flat` into the model's variables of the same paths (each cast to the variable's dtype and put
    on its sharding); returns how many were loaded. A path the model lacks, or a shape mismatch, is an error."""
    state = nnx.state(model)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    seen = 0
    new = []
    for p, old in leaves:
        k = _key(p)
        if k not in flat:
            new.append(old)
            continue
        x = flat[k]
        if tuple(np.shape(x)) != tuple(old.shape):
            raise ValueError(f"weights {k!r}: shape {tuple(np.shape(x))} does not match the model's {tuple(old.shape)}")
        sharding = getattr(old, "sharding", None)
        x = jnp.asarray(x, dtype=old.dtype) if not isinstance(x, jax.Array) else x.astype(old.dtype)
        new.append(jax.device_put(x, sharding, may_alias=False) if sharding is not None else jnp.array(x, copy=True))
        seen += 1
    missing = sorted(set(flat) - {_key(p) for p, _ in leaves})
    if missing:
        raise ValueError(f"weights not in the model: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))
    return seen
