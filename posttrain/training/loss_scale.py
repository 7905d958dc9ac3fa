"""Loss scaling for float16 training (Micikevicius et al. 2018, "Mixed Precision Training"): the (mean) loss is
multiplied by S before the backward pass, so that small activation gradients do not flush to zero in float16, and
the gradients are divided by S again (in float32) before the optimizer sees them.

Dynamic scaling (`trainer.loss_scale: dynamic`, what `auto` picks for float16 compute) adapts S: a step whose
gradients overflow (a non-finite value anywhere) is skipped (the parameters and optimizer state stay as they were),
S halves, and the overflow is counted; after `period` finite steps in a row S doubles. A fixed float scales by that
constant (overflowing steps are still skipped); `none` (what `auto` picks otherwise) scales by 1.

The state is a small pytree (`LossScale`: scale, finite steps since the last change, overflows so far) held in the
train state and saved in every checkpoint, so a resumed run goes on with the scale it had. A few lines of our own
over the jitted step rather than a dependency: Optax has no loss scaling, and DeepMind's `jmp` (its
`DynamicLossScale` is the same rule) has had no release since 2022.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LossScale", "INITIAL_SCALE", "PERIOD", "loss_scale_for"]

INITIAL_SCALE = 2.0 ** 15  #: dynamic scaling's first scale (as jmp's examples; PyTorch's GradScaler starts at 2^16)
PERIOD = 2000  #: finite steps in a row after which the dynamic scale doubles (PyTorch's and jmp's default)
FACTOR = 2.0  #: the dynamic scale's step, down and up


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossScale:
    """The loss scale of the train state: `scale` (float32), `good_steps` (finite steps since the last change,
    int32), `overflows` (steps skipped for overflowing gradients so far, int32); `dynamic` and `period` (static)
    say whether and when it changes."""

    scale: jax.Array
    good_steps: jax.Array
    overflows: jax.Array
    dynamic: bool = dataclasses.field(default=True, metadata={"static": True})
    period: int = dataclasses.field(default=PERIOD, metadata={"static": True})

    @classmethod
    def start(cls, scale: float = INITIAL_SCALE, *, dynamic: bool = True, period: int = PERIOD) -> "LossScale":
        return cls(np.float32(scale), np.int32(0), np.int32(0), dynamic=dynamic, period=int(period))

    def factor(self, weight: jax.Array) -> jax.Array:
        """What a micro-batch's unnormalised loss sum is multiplied by before the backward pass: the scale over the
        micro-batch's normaliser (`weight`, at least 1), so that the scale applies to its mean loss whatever the
        micro-batch's size; its float32 gradients are divided by the same factor (`posttrain.training.trainer`)."""
        return self.scale / jnp.maximum(weight, 1.0)

    def adjust(self, finite: jax.Array) -> "LossScale":
        """The state after a step whose gradients were `finite` (a traced bool): see the module docstring."""
        overflows = self.overflows + (~finite).astype(jnp.int32)
        if not self.dynamic:
            return dataclasses.replace(self, overflows=overflows)
        grow = finite & (self.good_steps + 1 >= self.period)
        scale = jnp.where(finite, jnp.where(grow, self.scale * FACTOR, self.scale),
                          jnp.maximum(self.scale / FACTOR, 1.0))
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return dataclasses.replace(self, scale=scale.astype(jnp.float32), good_steps=good.astype(jnp.int32),
                                   overflows=overflows)

    def state_dict(self) -> dict:
        return {"scale": np.asarray(self.scale, np.float32), "good_steps": np.asarray(self.good_steps, np.int32),
                "overflows": np.asarray(self.overflows, np.int32)}

    def load(self, state: dict) -> "LossScale":
        return dataclasses.replace(self, scale=np.float32(state["scale"]), good_steps=np.int32(state["good_steps"]),
                                   overflows=np.int32(state["overflows"]))


def loss_scale_for(setting: Literal["auto", "dynamic", "none"] | float, compute_dtype: str) -> LossScale | None:
    """The train state's loss scale for `trainer.loss_scale` (`auto`: dynamic with float16 compute, else none);
    None: no scaling."""
    if setting == "auto":
        setting = "dynamic" if compute_dtype == "float16" else "none"
    if setting == "none":
        return None
    if setting == "dynamic":
        return LossScale.start()
    return LossScale.start(float(setting), dynamic=False)
