"""LoRA and QLoRA on our stacked Transformer: attach adapters, quantise frozen bases to NF4, switch off, merge.

LoRA (Hu et al. 2021, arXiv:2106.09685): a targeted linear map W gets y = x W + (alpha / r) (x A) B with
A [*in, r] and B [r, *out] trained (`nnx.LoRAParam`) and W frozen; B starts at zero, so the adapted model
starts equal to the base. Per-layer weights are stacked on a leading "layers" axis and scanned, so an
adapter on e.g. `layers.self_attn.q_proj` is one stacked pair A [L, *in, r], B [L, r, *out]; the `Linear`
module already applies them (see `posttrain.models.layers.Linear`).

Qwix's `apply_lora_to_model` intercepts ops at trace time, which does not fit layers stacked by
`nnx.vmap` and run under `lax.scan`; we attach the parameters ourselves. The NF4 quantisation of QLoRA
(Dettmers et al. 2023, arXiv:2305.14314) does use Qwix: `qwix.quantize(kernel, "nf4", tiled_axes=...)`
stores 4-bit bucket indices (uint4) and absmax scales per block of `block_size` (64) consecutive inputs,
with the NF4 code book of the paper's appendix E; `qwix.dequantize` restores the kernel on the fly in
every forward pass. (Double quantisation of the scales is not implemented: the scales stay float32.)

Module paths are dotted attribute paths such as `layers.self_attn.q_proj` or `lm_head`; `target` is a
regular expression that must match a whole path (`re.fullmatch`), e.g.
`.*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)`.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.models.layers import Linear, dtype_of

__all__ = [
    "DEFAULT_TARGET",
    "NF4Quant",
    "QuantizedKernel",
    "QuantScale",
    "linears",
    "attach",
    "quantize_base",
    "merge",
    "has_lora",
    "set_enabled",
    "disabled",
    "lora_param_count",
]

DEFAULT_TARGET = r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


class QuantizedKernel(nnx.Variable):
    """A frozen, quantised base kernel (NF4 bucket indices, uint4). Never trained, never decayed."""


class QuantScale(nnx.Variable):
    """Per-block absmax scales of a quantised kernel (float32)."""


class NF4Quant(nnx.Module):
    """How to turn a stored NF4 kernel back into floats: `dequantize(qvalue) = codebook[qvalue] * scale`."""

    def __init__(self, scale: jax.Array, axes, dtype: str):
        self.scale = QuantScale(scale, out_sharding=axes, eager_sharding=False)
        self.dtype = dtype  # dtype of the dequantised kernel

    def dequantize(self, qvalue: jax.Array) -> jax.Array:
        import qwix  # lazy: only QLoRA needs qwix

        q = qwix.QArray(qvalue, self.scale[...], None, "nf4")
        return qwix.dequantize(q).astype(dtype_of(self.dtype))


def linears(model: nnx.Module) -> Iterator[tuple[str, Linear]]:
    """(dotted path, Linear) for every linear map of the model, in graph order."""
    for path, node in nnx.iter_modules(model):
        if isinstance(node, Linear):
            yield ".".join(str(p) for p in path), node


def _is_stacked(path: str) -> bool:
    """Per-layer weights stacked on a leading axis: the decoder's `layers.*` and a vision tower's
    `vision_tower.layers.*`."""
    parts = path.split(".")
    return parts[0] == "layers" or parts[:2] == ["vision_tower", "layers"]


def _match(model, target: str) -> list[tuple[str, Linear]]:
    pattern = re.compile(target)
    found = [(p, lin) for p, lin in linears(model) if pattern.fullmatch(p)]
    if not found:
        names = sorted({p for p, _ in linears(model)})
        raise ValueError(f"LoRA target {target!r} matches no linear module; module paths: {', '.join(names)}")
    return found


def _axes(lin: Linear):
    meta = getattr(lin.kernel, "out_sharding", None)
    return tuple(meta) if meta else None


def attach(model: nnx.Module, *, rank: int, alpha: float, target: str = DEFAULT_TARGET, seed: int = 0,
           init: str = "kaiming", dtype: str = "float32") -> list[str]:
    """Adds LoRA adapters (A, B as `nnx.LoRAParam`) to every Linear whose path fully matches `target`.

    A is initialised `kaiming` (uniform in ±1/sqrt(fan_in), PyTorch's default for a linear layer) or
    `gaussian` (normal with std 1/rank); B is zero. The scale is alpha / rank. Returns the matched paths.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, found {rank}")
    if init not in ("kaiming", "gaussian"):
        raise ValueError(f"LoRA init {init!r}; accepted: kaiming, gaussian")
    key = jax.random.key(seed)
    paths = []
    for i, (path, lin) in enumerate(_match(model, target)):
        if lin.lora_a is not None:
            raise ValueError(f"{path} already has a LoRA adapter")
        stacked = _is_stacked(path)
        shape = tuple(lin.kernel[...].shape)
        lead = shape[:1] if stacked else ()
        n_in = len(lin.in_shape)
        axes = _axes(lin)
        if axes is not None:
            lead_axes, in_axes, out_axes = axes[: len(lead)], axes[len(lead): len(lead) + n_in], axes[len(lead) + n_in:]
        else:
            lead_axes, in_axes, out_axes = (None,) * len(lead), (None,) * n_in, (None,) * len(lin.out_shape)
        fan_in = math.prod(lin.in_shape)
        a_shape = (*lead, *lin.in_shape, rank)
        k = jax.random.fold_in(key, i)
        if init == "kaiming":
            bound = 1.0 / math.sqrt(fan_in)
            a = jax.random.uniform(k, a_shape, jnp.float32, -bound, bound)
        else:
            a = jax.random.normal(k, a_shape, jnp.float32) / rank
        b = jnp.zeros((*lead, rank, *lin.out_shape), jnp.float32)
        pd = dtype_of(dtype)
        lin.lora_a = nnx.data(nnx.LoRAParam(a.astype(pd), out_sharding=(*lead_axes, *in_axes, "lora_rank"),
                                            eager_sharding=False))
        lin.lora_b = nnx.data(nnx.LoRAParam(b.astype(pd), out_sharding=(*lead_axes, "lora_rank", *out_axes),
                                            eager_sharding=False))
        lin.lora_scale = float(alpha) / rank
        lin.lora_enabled = True
        paths.append(path)
    return paths


def _block_axis(shape: tuple[int, ...], first: int, n_in: int, block: int) -> tuple[int, int]:
    """The axis tiled in blocks (and the tile size): the last input axis divisible by `block`, else any
    divisible axis, else the largest axis in one block."""
    in_axes = list(range(first, first + n_in))
    out_axes = list(range(first + n_in, len(shape)))
    for ax in list(reversed(in_axes)) + out_axes:
        if shape[ax] % block == 0:
            return ax, block
    ax = max(in_axes + out_axes, key=lambda a: shape[a])
    return ax, shape[ax]


def quantize_base(model: nnx.Module, *, target: str = DEFAULT_TARGET, qtype: str = "nf4",
                  block_size: int = 64) -> list[str]:
    """Stores the kernels of the matched Linears as NF4 (QLoRA's frozen base); returns the matched paths.

    The kernel becomes a `QuantizedKernel` (uint4 bucket indices) and `linear.quant` an `NF4Quant` holding
    the float32 absmax scales of each block of `block_size` elements along the (last divisible) input axis,
    per output unit and per layer.
    """
    import qwix  # lazy: only QLoRA needs qwix

    if qtype != "nf4":
        raise ValueError(f"quantisation {qtype!r} is not supported; supported: nf4")
    paths = []
    for path, lin in _match(model, target):
        if lin.quant is not None:
            continue
        w = lin.kernel[...]
        dtype = str(jnp.dtype(w.dtype))
        first = 1 if _is_stacked(path) else 0
        ax, tile = _block_axis(tuple(w.shape), first, len(lin.in_shape), block_size)
        channel = tuple(a for a in range(w.ndim) if a != ax)
        q = qwix.quantize(w.astype(jnp.float32), "nf4", channelwise_axes=channel, tiled_axes={ax: tile})
        axes = _axes(lin)
        scale_axes = tuple(None if (i == ax) else a for i, a in enumerate(axes)) if axes else None
        lin.quant = nnx.data(NF4Quant(q.scale.astype(jnp.float32), scale_axes, dtype))
        lin.kernel = QuantizedKernel(q.qvalue, out_sharding=axes, eager_sharding=False)
        paths.append(path)
    return paths


def _delta(lin: Linear, stacked: bool) -> jax.Array:
    """(alpha / r) * A @ B reshaped to the kernel's shape [L?, *in, *out] (float32)."""
    a = lin.lora_a[...].astype(jnp.float32)
    b = lin.lora_b[...].astype(jnp.float32)
    lead = a.shape[:1] if stacked else ()
    r = a.shape[-1]
    n_in, n_out = math.prod(lin.in_shape), math.prod(lin.out_shape)
    a2 = a.reshape(*lead, n_in, r)
    b2 = b.reshape(*lead, r, n_out)
    d = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST)
    return (lin.lora_scale * d).reshape(*lead, *lin.in_shape, *lin.out_shape)


def merge(model: nnx.Module) -> nnx.Module:
    """Folds every adapter into its base kernel, W <- W + (alpha / r) A @ B, and removes the adapters.

    Quantised (QLoRA) bases are dequantised first, so the result is an ordinary model in the config's
    parameter dtype that `save_pretrained` can write. Works in place on the modules (the merged kernels are
    new Variables, so a state the model shares Variables with is left as it was); returns the model.
    """
    for path, lin in list(linears(model)):
        if lin.lora_a is None and lin.quant is None:
            continue
        stacked = _is_stacked(path)
        axes = _axes(lin)
        if lin.quant is not None:
            dtype = lin.quant.dtype
        else:
            dtype = str(jnp.dtype(lin.kernel[...].dtype))
        w = lin.base_kernel().astype(jnp.float32)
        if lin.lora_a is not None:
            w = w + _delta(lin, stacked)
        # A new Variable, not set_value: a model from `nnx.merge` shares its Variables with the state it
        # came from (e.g. a Trainer's), which must keep the unmerged weights.
        lin.kernel = nnx.Param(w.astype(dtype_of(dtype)), out_sharding=axes, eager_sharding=False)
        lin.quant = None
        lin.lora_a = None
        lin.lora_b = None
        lin.lora_scale = 0.0
        lin.lora_enabled = True
    return model


def has_lora(model: nnx.Module) -> bool:
    return any(lin.lora_a is not None for _, lin in linears(model))


def set_enabled(model: nnx.Module, enabled: bool) -> None:
    """Turns every adapter on or off (off = the base model, e.g. RL's reference policy)."""
    for _, lin in linears(model):
        lin.lora_enabled = bool(enabled)


@contextlib.contextmanager
def disabled(model: nnx.Module):
    """`with lora.disabled(model): ...` runs the base model; adapters come back on exit."""
    before = [(lin, lin.lora_enabled) for _, lin in linears(model)]
    set_enabled(model, False)
    try:
        yield model
    finally:
        for lin, flag in before:
            lin.lora_enabled = flag


def lora_param_count(model: nnx.Module) -> int:
    state = nnx.state(model, nnx.LoRAParam)
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))
