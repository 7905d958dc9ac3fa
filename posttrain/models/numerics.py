"""A built model's compute dtype, changed after it is built: `with_compute_dtype(model, dtype)` makes the same
weights compute in another dtype (the RL sampler's `rollout.compute_dtype`, independent of the trainer's).

The modules read their compute dtype from their `ModelConfig` (`cfg`) or hold it as `compute_dtype` (linear maps,
experts); both are static parts of the model's structure (its `nnx` graph definition), so a model changed here is
another structure: programs compiled for it are its own, and the weights (its `nnx.State`) load into it as they are
(they stay in the parameter dtype, cast at each use). Whether the backend runs the dtype at all is the kernel
switch's to say (`posttrain.models.kernels.check_compute_dtype`).
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from posttrain.models.config import ModelConfig
from posttrain.models.layers import dtype_of

__all__ = ["with_compute_dtype"]


def with_compute_dtype(model: nnx.Module, dtype: str | None) -> nnx.Module:
    """`model` (changed in place, and returned) computing in `dtype` (float32, bfloat16, float16); None leaves it
    as it is. Only the compute dtype changes: parameters, caches' layouts and kernels stay."""
    if dtype is None or model.cfg.compute_dtype == dtype:
        return model
    new_dtype = dtype_of(dtype)
    for _, module in nnx.iter_modules(model):
        for name, value in list(vars(module).items()):
            if isinstance(value, ModelConfig):
                setattr(module, name, dataclasses.replace(value, compute_dtype=dtype))
            elif name == "compute_dtype":
                setattr(module, name, new_dtype)
    return model
