"""The loss protocol between an algorithm and the trainer (`posttrain.training.trainer`).

A loss function is called ``loss_fn(model, micro_batch) -> (loss_sum, weight, metrics)``: `loss_sum` an
unnormalised scalar, `weight` its normaliser for this micro-batch (not depending on the parameters), and
`metrics` a flat dict whose values are a scalar (summed over micro-batches) or a pair
`(numerator, denominator)` (reported as Σ numerator / Σ denominator, `reduce_metrics`). A loss that also
reads frozen models (a DPO reference, a distillation teacher) is wrapped with `uses_frozen` and called
``fn(model, micro_batch, frozen)``. Algorithms build their losses against this module; the trainer runs them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["LossFn", "UsesFrozen", "reduce_metrics", "uses_frozen"]

LossFn = Callable[[nnx.Module, dict[str, jax.Array]], tuple[jax.Array, jax.Array, dict[str, Any]]]


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, jax.Array]:
    """Turns accumulated metrics into values: a (num, den) pair becomes num / den, a scalar stays. Inside a
    compiled step (traced values) this is part of the step; on host values (floats, numpy) it computes with numpy
    (compiling nothing), with the same float32 arithmetic."""
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(metrics)):
        return _reduce_on_host(metrics)
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (tuple, list)):
            num, den = v
            out[k] = jnp.asarray(num, jnp.float32) / jnp.maximum(jnp.asarray(den, jnp.float32), 1e-12)
        else:
            out[k] = jnp.asarray(v, jnp.float32)
    return out


def _reduce_on_host(metrics: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (tuple, list)):
            num, den = (np.asarray(x, np.float32) for x in v)
            out[k] = np.float32(num / np.maximum(den, np.float32(1e-12)))
        else:
            out[k] = np.asarray(v, np.float32)
    return out


@dataclasses.dataclass(frozen=True)
class UsesFrozen:
    """A loss that also takes frozen models: called `fn(model, batch, frozen)`, `frozen` = {name: model}
    for `names` (see the module docstring). Hashable, so the trainer's compile cache keys on it."""

    fn: Callable
    names: tuple[str, ...]
    rows_per_example: int = 1

    def __call__(self, model, batch, frozen):
        return self.fn(model, batch, frozen)


def uses_frozen(fn: Callable, *names: str, rows_per_example: int = 1) -> UsesFrozen:
    """Marks `fn(model, batch, frozen)` as a loss over the trainer's frozen models `names` ("base" = the
    LoRA model with adapters off); `rows_per_example` keeps that many consecutive rows in one micro-batch."""
    return UsesFrozen(fn, tuple(names), int(rows_per_example))
