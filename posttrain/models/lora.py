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

Mixtures of experts (what LoRA covers): every linear map -- attention, the dense MLPs of dense layers, Qwen2-MoE's
shared expert and its gate, the router (`layers.moe.gate`, not in the default target) -- and the stacked expert
weights `layers.moe.experts.{gate_proj,up_proj,down_proj}` (matched by the default target). An expert weight
[L, E, in, out] gets one adapter pair per expert, A [L, E, in, r] and B [L, E, r, out] (`moe.ExpertAdapter`), and
each forward pass adds scale * A @ B to the weight before the expert compute (so both kernel sets and expert
parallelism run unchanged; the cost is one [E, in, out] product per weight and layer, and the weight-sized
gradient of the merged weight, transient, one layer at a time). QLoRA quantises the matched linear maps only:
expert weights stay in the parameter dtype.

Compiles: attaching, quantising and merging each run as one compiled program over all the model's kernels (not
one eager op per leaf), bit for bit what eager ops give (see `_rounded`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.models.layers import Linear, dtype_of
from posttrain.models.moe import EXPERT_WEIGHTS, ExpertAdapter, Experts

__all__ = [
    "DEFAULT_TARGET",
    "NF4Quant",
    "QuantScale",
    "QuantizedKernel",
    "attach",
    "disabled",
    "expert_weights",
    "has_lora",
    "linears",
    "lora_param_count",
    "merge",
    "quantize_base",
    "set_enabled",
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
        return _nf4_dequantize(qvalue, self.scale[...], self.dtype)


def _nf4_dequantize(qvalue: jax.Array, scale: jax.Array, dtype: str) -> jax.Array:
    """codebook[qvalue] * scale (qwix), in `dtype`."""
    import qwix  # lazy: only QLoRA needs qwix

    return qwix.dequantize(qwix.QArray(qvalue, scale, None, "nf4")).astype(dtype_of(dtype))


def linears(model: nnx.Module) -> Iterator[tuple[str, Linear]]:
    """(dotted path, Linear) for every linear map of the model, in graph order."""
    for path, node in nnx.iter_modules(model):
        if isinstance(node, Linear):
            yield ".".join(str(p) for p in path), node


def expert_weights(model: nnx.Module) -> Iterator[tuple[str, Experts, str]]:
    """(dotted path, Experts module, weight name) for every stacked expert weight of a mixture of experts, e.g.
    `layers.moe.experts.gate_proj`."""
    for path, node in nnx.iter_modules(model):
        if isinstance(node, Experts):
            base = ".".join(str(p) for p in path)
            for kind in EXPERT_WEIGHTS:
                yield f"{base}.{kind}", node, kind


def _adapters(model: nnx.Module) -> Iterator[tuple[Experts, str, ExpertAdapter]]:
    for _, experts, kind in expert_weights(model):
        adapter = getattr(experts, kind + "_lora")
        if adapter is not None:
            yield experts, kind, adapter


def _is_stacked(path: str) -> bool:
    """Per-layer weights stacked on a leading axis: the decoder's `layers.*` and a vision tower's
    `vision_tower.layers.*`."""
    parts = path.split(".")
    return parts[0] == "layers" or parts[:2] == ["vision_tower", "layers"]


def _match(model, target: str, allow_none: bool = False) -> list[tuple[str, Linear]]:
    pattern = re.compile(target)
    found = [(p, lin) for p, lin in linears(model) if pattern.fullmatch(p)]
    if not found and not allow_none:
        names = sorted({p for p, _ in linears(model)} | {p for p, _, _ in expert_weights(model)})
        raise ValueError(f"LoRA target {target!r} matches no linear module; module paths: {', '.join(names)}")
    return found


def _axes(lin: Linear):
    meta = getattr(lin.kernel, "out_sharding", None)
    return tuple(meta) if meta else None


class _Site(NamedTuple):
    """Where one adapter pair goes: a Linear (`weight` None) or a stacked expert weight (`owner.<weight>`), with
    the pair's shapes, logical axes, and the fan-in of A's kaiming bound."""

    path: str
    owner: nnx.Module
    weight: str | None
    a_shape: tuple
    b_shape: tuple
    a_axes: tuple
    b_axes: tuple
    fan_in: int


def _linear_site(path: str, lin: Linear, rank: int) -> _Site:
    """A [(L,) *in, r] and B [(L,) r, *out] of a Linear (L: the stacked layers)."""
    if lin.lora_a is not None:
        raise ValueError(f"{path} already has a LoRA adapter")
    shape = tuple(lin.kernel[...].shape)
    n_lead, n_in = (1 if _is_stacked(path) else 0), len(lin.in_shape)
    lead = shape[:n_lead]
    axes = _axes(lin) or (None,) * len(shape)
    lead_axes, in_axes, out_axes = axes[:n_lead], axes[n_lead: n_lead + n_in], axes[n_lead + n_in:]
    return _Site(path, lin, None, (*lead, *lin.in_shape, rank), (*lead, rank, *lin.out_shape),
                 (*lead_axes, *in_axes, "lora_rank"), (*lead_axes, "lora_rank", *out_axes), math.prod(lin.in_shape))


def _expert_site(path: str, experts: Experts, kind: str, rank: int) -> _Site:
    """A [(L,) E, in, r] and B [(L,) E, r, out] of a stacked expert weight [(L,) E, in, out]."""
    if getattr(experts, kind + "_lora") is not None:
        raise ValueError(f"{path} already has a LoRA adapter")
    w = getattr(experts, kind)
    axes = tuple(getattr(w, "out_sharding", None) or (None,) * w[...].ndim)
    *lead, d_in, d_out = w[...].shape
    return _Site(path, experts, kind, (*lead, d_in, rank), (*lead, rank, d_out), (*axes[:-2], axes[-2], "lora_rank"),
                 (*axes[:-2], "lora_rank", axes[-1]), d_in)


def _rounded(x: jax.Array, zero: jax.Array) -> jax.Array:
    """x + zero, `zero` a run-time -0.0 (x + -0.0 == x, bit for bit), so that x is rounded as a separate eager op
    rounds it: XLA cannot fold a run-time value away, so it neither fuses the product x into the next sum (one
    multiply-add; with the -0.0 addend a multiply-add rounds like the product alone) nor folds a following
    division into x's own constant factor. This is what keeps one program per tree bitwise equal to eager ops."""
    return x + zero


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _lora_init(seed: jax.Array, spreads: tuple, zero: jax.Array, shapes: tuple, init: str, dtype: str) -> list:
    """(A, B) of every site, one program: shapes = ((a_shape, b_shape), ...); site i's A is drawn from
    `fold_in(key(seed), i)`, kaiming (uniform in ±spreads[i]) or gaussian (standard normal / spreads[i]); B is
    zero. The spreads come in at run time, as eager calls pass them, and the normal draw is `_rounded`."""
    key = jax.random.key(seed)
    pd = dtype_of(dtype)
    out = []
    for i, ((a_shape, b_shape), spread) in enumerate(zip(shapes, spreads, strict=True)):
        k = jax.random.fold_in(key, i)
        if init == "kaiming":
            a = jax.random.uniform(k, a_shape, jnp.float32, -spread, spread)
        else:
            a = _rounded(jax.random.normal(k, a_shape, jnp.float32), zero) / spread
        out.append((a.astype(pd), jnp.zeros(b_shape, pd)))
    return out


def attach(model: nnx.Module, *, rank: int, alpha: float, target: str = DEFAULT_TARGET, seed: int = 0,
           init: str = "kaiming", dtype: str = "float32") -> list[str]:
    """Adds LoRA adapters (A, B as `nnx.LoRAParam`) to every Linear, and every stacked expert weight of a mixture
    of experts, whose path fully matches `target`.

    A is initialised `kaiming` (uniform in ±1/sqrt(fan_in), PyTorch's default for a linear layer) or
    `gaussian` (normal with std 1/rank); B is zero. The scale is alpha / rank. All adapters are made by one
    compiled program. Returns the matched paths.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, found {rank}")
    if init not in ("kaiming", "gaussian"):
        raise ValueError(f"LoRA init {init!r}; accepted: kaiming, gaussian")
    pattern = re.compile(target)
    experts = [(p, e, kind) for p, e, kind in expert_weights(model) if pattern.fullmatch(p)]
    sites = [_linear_site(p, lin, rank) for p, lin in _match(model, target, allow_none=bool(experts))]
    sites += [_expert_site(p, e, kind, rank) for p, e, kind in experts]
    # kaiming: the bound 1/sqrt(fan_in); gaussian: the std's inverse, the rank
    spreads = tuple(np.float32(1.0 / math.sqrt(s.fan_in) if init == "kaiming" else rank) for s in sites)
    # the seed as jax.random.key converts it (an int64 scalar, int32 without x64), by a transfer, not a program
    pairs = _lora_init(np.int64(seed), spreads, np.float32(-0.0),
                       tuple((s.a_shape, s.b_shape) for s in sites), init, dtype)
    scale = float(alpha) / rank
    for s, (a, b) in zip(sites, pairs, strict=True):
        a = nnx.LoRAParam(a, out_sharding=s.a_axes, eager_sharding=False)
        b = nnx.LoRAParam(b, out_sharding=s.b_axes, eager_sharding=False)
        if s.weight is None:
            s.owner.lora_a, s.owner.lora_b = nnx.data(a), nnx.data(b)
            s.owner.lora_scale, s.owner.lora_enabled = scale, True
        else:
            setattr(s.owner, s.weight + "_lora", nnx.data(ExpertAdapter(a, b, scale)))
    return [s.path for s in sites]


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


@functools.partial(jax.jit, static_argnums=1)
def _nf4_quantize(kernels: tuple, blocks: tuple) -> list:
    """(uint4 codes, float32 scales) of every kernel, one program; blocks = ((tiled axis, tile size), ...)."""
    import qwix  # lazy: only QLoRA needs qwix

    out = []
    for w, (ax, tile) in zip(kernels, blocks, strict=True):
        channel = tuple(a for a in range(w.ndim) if a != ax)
        q = qwix.quantize(w.astype(jnp.float32), "nf4", channelwise_axes=channel, tiled_axes={ax: tile})
        out.append((q.qvalue, q.scale.astype(jnp.float32)))
    return out


def quantize_base(model: nnx.Module, *, target: str = DEFAULT_TARGET, qtype: str = "nf4",
                  block_size: int = 64) -> list[str]:
    """Stores the kernels of the matched Linears as NF4 (QLoRA's frozen base); returns the matched paths.

    The kernel becomes a `QuantizedKernel` (uint4 bucket indices) and `linear.quant` an `NF4Quant` holding
    the float32 absmax scales of each block of `block_size` elements along the (last divisible) input axis,
    per output unit and per layer. All kernels are quantised by one compiled program.
    """
    if qtype != "nf4":
        raise ValueError(f"quantisation {qtype!r} is not supported; supported: nf4")
    pattern = re.compile(target)
    experts_only = any(pattern.fullmatch(p) for p, _, _ in expert_weights(model))
    # expert weights stay unquantised; an already quantised kernel is left as it is
    sites = [(p, lin) for p, lin in _match(model, target, allow_none=experts_only) if lin.quant is None]
    if not sites:
        return []
    blocks = tuple(_block_axis(tuple(lin.kernel[...].shape), 1 if _is_stacked(p) else 0, len(lin.in_shape),
                               block_size) for p, lin in sites)
    codes = _nf4_quantize(tuple(lin.kernel[...] for _, lin in sites), blocks)
    for (_, lin), (ax, _), (qvalue, scale) in zip(sites, blocks, codes, strict=True):
        dtype = str(jnp.dtype(lin.kernel[...].dtype))
        axes = _axes(lin)
        scale_axes = tuple(None if (i == ax) else a for i, a in enumerate(axes)) if axes else None
        lin.quant = nnx.data(NF4Quant(scale, scale_axes, dtype))
        lin.kernel = QuantizedKernel(qvalue, out_sharding=axes, eager_sharding=False)
    return [p for p, _ in sites]


def _delta(a: jax.Array, b: jax.Array, zero: jax.Array, stacked: bool, in_shape, out_shape, scale: float):
    """scale * A @ B reshaped to the kernel's shape [L?, *in, *out] (float32)."""
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    lead = a.shape[:1] if stacked else ()
    r = a.shape[-1]
    a2 = a.reshape(*lead, math.prod(in_shape), r)
    b2 = b.reshape(*lead, r, math.prod(out_shape))
    d = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST)
    return _rounded(scale * d, zero).reshape(*lead, *in_shape, *out_shape)


@functools.partial(jax.jit, static_argnums=1)
def _lora_merge(arrays: tuple, specs: tuple, zero: jax.Array) -> list:
    """Every merged kernel in its dtype, one program. arrays[i] = (kernel or NF4 codes, NF4 scales or None, A or
    None, B or None); specs[i] = ("linear", stacked, in_shape, out_shape, lora scale, dtype, quantised) or
    ("experts", scale, dtype)."""
    out = []
    for (kernel, qscale, a, b), spec in zip(arrays, specs, strict=True):
        if spec[0] == "experts":
            _, scale, dtype = spec
            adapter = ExpertAdapter(nnx.LoRAParam(a), nnx.LoRAParam(b), scale)
            w = kernel.astype(jnp.float32) + _rounded(adapter.delta(jnp.float32), zero)
        else:
            _, stacked, in_shape, out_shape, scale, dtype, quantised = spec
            w = _nf4_dequantize(kernel, qscale, dtype) if quantised else kernel
            w = _rounded(w.astype(jnp.float32), zero)
            if a is not None:
                w = w + _delta(a, b, zero, stacked, in_shape, out_shape, scale)
        out.append(w.astype(dtype_of(dtype)))
    return out


def _merge_inputs(path: str, lin: Linear) -> tuple[tuple, tuple]:
    """(arrays, spec) of `_lora_merge` for a Linear with an adapter or a quantised kernel."""
    quantised = lin.quant is not None
    dtype = lin.quant.dtype if quantised else str(jnp.dtype(lin.kernel[...].dtype))
    lora = lin.lora_a is not None
    arrays = (lin.kernel[...], lin.quant.scale[...] if quantised else None, lin.lora_a[...] if lora else None,
              lin.lora_b[...] if lora else None)
    return arrays, ("linear", _is_stacked(path), lin.in_shape, lin.out_shape, lin.lora_scale, dtype, quantised)


def merge(model: nnx.Module) -> nnx.Module:
    """Folds every adapter into its base kernel, W <- W + (alpha / r) A @ B, and removes the adapters.

    Quantised (QLoRA) bases are dequantised first, so the result is an ordinary model in the config's
    parameter dtype that `save_pretrained` can write. All kernels are merged by one compiled program. Works in
    place on the modules (the merged kernels are new Variables, so a state the model shares Variables with is left
    as it was); returns the model.
    """
    lins = [(p, lin) for p, lin in linears(model) if lin.lora_a is not None or lin.quant is not None]
    adapters = list(_adapters(model))
    if not lins and not adapters:
        return model
    inputs = [_merge_inputs(p, lin) for p, lin in lins]
    for experts, kind, adapter in adapters:
        w = getattr(experts, kind)[...]
        inputs.append(((w, None, adapter.lora_a[...], adapter.lora_b[...]),
                       ("experts", adapter.scale, str(jnp.dtype(w.dtype)))))
    merged = _lora_merge(tuple(x for x, _ in inputs), tuple(s for _, s in inputs), np.float32(-0.0))
    # New Variables, not set_value: a model from `nnx.merge` shares its Variables with the state it came from
    # (e.g. a Trainer's), which must keep the unmerged weights.
    for (_, lin), w in zip(lins, merged[: len(lins)], strict=True):
        lin.kernel = nnx.Param(w, out_sharding=_axes(lin), eager_sharding=False)
        lin.quant, lin.lora_a, lin.lora_b = None, None, None
        lin.lora_scale, lin.lora_enabled = 0.0, True
    for (experts, kind, _), w in zip(adapters, merged[len(lins):], strict=True):
        sharding = getattr(getattr(experts, kind), "out_sharding", None)
        setattr(experts, kind, nnx.Param(w, out_sharding=sharding, eager_sharding=False))
        setattr(experts, kind + "_lora", None)
    return model


def has_lora(model: nnx.Module) -> bool:
    return any(lin.lora_a is not None for _, lin in linears(model)) or any(True for _ in _adapters(model))


def _switches(model: nnx.Module) -> list[tuple[object, str]]:
    """(object, attribute) of every adapter's on/off flag: Linears' `lora_enabled`, expert adapters' `enabled`."""
    return [(lin, "lora_enabled") for _, lin in linears(model)] + [(a, "enabled") for _, _, a in _adapters(model)]


def set_enabled(model: nnx.Module, enabled: bool) -> None:
    """Turns every adapter on or off (off = the base model, e.g. RL's reference policy)."""
    for obj, attr in _switches(model):
        setattr(obj, attr, bool(enabled))


@contextlib.contextmanager
def disabled(model: nnx.Module):
    """`with lora.disabled(model): ...` runs the base model; adapters come back on exit."""
    before = [(obj, attr, getattr(obj, attr)) for obj, attr in _switches(model)]
    set_enabled(model, False)
    try:
        yield model
    finally:
        for obj, attr, flag in before:
            setattr(obj, attr, flag)


def lora_param_count(model: nnx.Module) -> int:
    state = nnx.state(model, nnx.LoRAParam)
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))
