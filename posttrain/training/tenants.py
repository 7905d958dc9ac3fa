"""LoRA tenants over one frozen base: each its own adapters, optimizer state and accumulated gradients.

The training service of the Tinker API (`posttrain.serve.tinker`) holds one base model and any number of LoRA
training clients over it. A `Tenant` is one of them: a `LoraSpec` (rank, which parts train, the seed of A's
initialisation), its adapters (`nnx.LoRAParam`s only), an AdamW state and a float32 gradient accumulator. The base
weights are shared by every tenant and never trained; a tenant's arrays are its own, so tenants never touch each
other's weights. The API separates the two halves of a training step:

- `forward_backward(tenant, batch, loss)`: per-token log-probs of the batch's targets and the loss (a *sum* over
  tokens, `posttrain.algorithms.token_losses`); the gradient is added to the tenant's accumulator. With
  `forward_only` nothing is accumulated.
- `optim_step(tenant, adam)`: one AdamW update (`optax`, hyperparameters per call, decoupled weight decay, optional
  global-norm clipping) from the accumulated gradient, which then starts again from zero. A step whose gradient is
  not finite is not applied (`skipped`).

Adapters are placed as `posttrain.models.lora.attach` places them (A: kaiming from the tenant's seed, B: zero, so a
new tenant's model equals the base); the scale is `alpha / rank`. Shapes: a batch is padded to a power of two of
rows and a length bucket of columns (`TokenBatch`), so a program compiles once per (adapter structure, loss, rows,
bucket); every tenant of the same `LoraSpec` structure shares them. The optimizer update donates the optimizer
state and the accumulator; the adapters are not donated, so a snapshot taken for a sampler (`Tenant.params` as it
is) stays valid after later steps.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from posttrain.algorithms.sft import logprobs_from_hidden
from posttrain.algorithms.token_losses import LOSSES, token_loss
from posttrain.models import lora as lora_lib
from posttrain.sampling.scheduler import length_bucket, pow2
from posttrain.training.checkpoint import nested_to_tree

__all__ = ["AdamSettings", "LoraSpec", "Tenant", "TenantPool", "TokenBatch", "TokenRow"]

ATTN = r"q_proj|k_proj|v_proj|o_proj"
MLP = r"gate_proj|up_proj|down_proj"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """A tenant's adapters: rank, which parts carry them (attention, MLP / experts, the output head), the seed of
    A's initialisation and the scale numerator `alpha` (scale = alpha / rank)."""

    rank: int = 32
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int = 0
    alpha: float = 32.0

    def target(self) -> str:
        """The module-path pattern (`lora.attach`'s `target`) of the parts that train; a vision tower never."""
        parts = []
        if self.train_attn:
            parts.append(rf".*\.({ATTN})")
        if self.train_mlp:
            parts.append(rf".*\.({MLP})")
        if self.train_unembed:
            parts.append("lm_head")
        if not parts:
            raise ValueError("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
        return r"(?!vision_tower\.)(?:" + "|".join(parts) + ")"

    @property
    def structure(self) -> tuple:
        """What fixes the adapters' shapes and scale (tenants that share it share compiled programs)."""
        return (self.rank, float(self.alpha), self.target())

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> LoraSpec:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@dataclasses.dataclass(frozen=True)
class AdamSettings:
    """One `optim_step`'s AdamW hyperparameters (the Tinker API's `AdamParams`); `grad_clip_norm` 0 = no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclasses.dataclass
class Tenant:
    """One LoRA training client's state (module docstring). `steps`: optimizer updates applied."""

    spec: LoraSpec
    params: Any
    opt_state: Any
    grads: Any
    steps: int = 0


@dataclasses.dataclass(frozen=True)
class TokenRow:
    """One datum: input ids [N], target ids [N] and the loss's float inputs, each [N]."""

    input_ids: np.ndarray
    targets: np.ndarray
    inputs: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """Rows padded to [rows, columns] (rows: a power of two, columns: a length bucket); `valid` marks real
    positions; `lengths` the real length of each real row."""

    input_ids: np.ndarray
    targets: np.ndarray
    valid: np.ndarray
    inputs: dict[str, np.ndarray]
    lengths: tuple[int, ...]

    @classmethod
    def pack(cls, rows: Sequence[TokenRow], names: Sequence[str], max_len: int) -> TokenBatch:
        """`rows` padded; `names` the float inputs to carry (a row without one gets ones: optional weights)."""
        if not rows:
            raise ValueError("no data: forward_backward needs at least one datum")
        n = pow2(len(rows))
        t = length_bucket(max(len(r.input_ids) for r in rows), cap=max(max_len, 1))
        ids = np.zeros((n, t), np.int32)
        tgt = np.zeros((n, t), np.int32)
        valid = np.zeros((n, t), bool)
        floats = {k: np.zeros((n, t), np.float32) for k in names}
        for i, r in enumerate(rows):
            k = len(r.input_ids)
            ids[i, :k], tgt[i, :k], valid[i, :k] = r.input_ids, r.targets, True
            for name in names:
                floats[name][i, :k] = r.inputs.get(name, 1.0)
        return cls(ids, tgt, valid, floats, tuple(len(r.input_ids) for r in rows))

    def per_row(self, values: np.ndarray) -> list[np.ndarray]:
        """A [rows, columns] result cut back to each real row's length."""
        return [np.asarray(values[i, :k]) for i, k in enumerate(self.lengths)]


def _adamw() -> optax.GradientTransformation:
    return optax.inject_hyperparams(optax.adamw)(learning_rate=1e-4, b1=0.9, b2=0.95, eps=1e-12, weight_decay=0.0)


def _apply_update(params, opt_state, grads, hp: dict):
    """AdamW from the accumulated gradients with this call's hyperparameters (clipped to `grad_clip_norm` when it
    is > 0); not applied when the gradient is not finite. Returns the new params, optimizer state, a zero
    accumulator and the metrics."""
    grad_norm = optax.tree.norm(grads)
    clip = hp["grad_clip_norm"]
    scale = jnp.where((clip > 0) & (grad_norm > clip), clip / jnp.maximum(grad_norm, 1e-30), 1.0)
    scaled = jax.tree.map(lambda g, p: (g * scale).astype(p.dtype), grads, params)
    state = opt_state._replace(hyperparams={**opt_state.hyperparams, "learning_rate": hp["learning_rate"],
                                            "b1": hp["beta1"], "b2": hp["beta2"], "eps": hp["eps"],
                                            "weight_decay": hp["weight_decay"]})
    updates, new_state = _adamw().update(scaled, state, params)
    new_params = optax.apply_updates(params, updates)
    ok = jnp.isfinite(grad_norm)
    new_params = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_params, params)
    new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, state)
    zeros = jax.tree.map(jnp.zeros_like, grads)
    metrics = {"grad_norm": grad_norm, "update_norm": optax.tree.norm(updates), "skipped": 1.0 - ok}
    return new_params, new_state, zeros, metrics


class TenantPool:
    """The frozen base model and the compiled programs every tenant shares (module docstring).

    model: the base (a posttrain `Transformer`, no adapters); its arrays are shared, never copied or trained.
    logprob_chunk_size: tokens per vocabulary-projection chunk (None: the whole batch at once).
    """

    def __init__(self, model: nnx.Module, *, logprob_chunk_size: int | None = None):
        if lora_lib.has_lora(model):
            raise ValueError("the base model already carries LoRA adapters; serve a merged model")
        self.cfg = model.cfg
        self.base_graphdef, self.rest = nnx.split(model)
        self.chunk = logprob_chunk_size
        self._graphdefs: dict[tuple, Any] = {}  # LoraSpec.structure -> graphdef with adapters
        self._programs: dict[tuple, Any] = {}
        self._update = jax.jit(_apply_update, donate_argnums=(1, 2))
        self._zeros = jax.jit(lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p))
        self._init = jax.jit(lambda p: _adamw().init(p))

    @property
    def max_len(self) -> int:
        return int(self.cfg.max_position_embeddings)

    # ------------------------------------------------------------------ tenants
    def new(self, spec: LoraSpec) -> Tenant:
        """A fresh tenant: adapters placed by `spec` (A from its seed, B zero), a new AdamW state, zero gradients.
        A spec that places no adapter on this model is a ValueError naming the parts."""
        if spec.rank < 1:
            raise ValueError(f"lora_config.rank={spec.rank}: must be >= 1")
        model = nnx.merge(self.base_graphdef, self.rest)  # new modules over the same arrays
        try:
            lora_lib.attach(model, rank=spec.rank, alpha=spec.alpha, target=spec.target(), seed=spec.seed)
        except ValueError as e:
            raise ValueError(f"lora_config: {e}") from None
        graphdef, params, _ = nnx.split(model, nnx.LoRAParam, ...)
        self._graphdefs.setdefault(spec.structure, graphdef)
        # committed to their devices, as restored and updated arrays are: one compiled program serves them all
        params = _committed(params)
        return Tenant(spec, params, _committed(self._init(params)), _committed(self._zeros(params)))

    def restore(self, spec: LoraSpec, params, opt_state=None, steps: int = 0) -> Tenant:
        """A tenant with saved adapters (and optimizer state; None: a fresh one) in the live structures."""
        tenant = self.new(spec)
        tenant.params = _like(params, tenant.params)
        if opt_state is not None:
            tenant.opt_state = _like(opt_state, tenant.opt_state)
        tenant.steps = steps
        return tenant

    def model(self, spec: LoraSpec | None = None, params=None) -> nnx.Module:
        """A model over the shared base with `params` as its adapters (None: the base itself), for a sampler."""
        if spec is None:
            return nnx.merge(self.base_graphdef, self.rest)
        return nnx.merge(self._graphdef(spec), params, self.rest)

    def _graphdef(self, spec: LoraSpec):
        if spec.structure not in self._graphdefs:
            self.new(spec)
        return self._graphdefs[spec.structure]

    # ------------------------------------------------------------------ steps
    def forward_backward(self, tenant: Tenant, batch: TokenBatch, loss: str,
                         config: tuple[tuple[str, float], ...] = (), *, forward_only: bool = False):
        """(per-row log-probs of the targets, the loss sum) of `batch` under the tenant's adapters; unless
        `forward_only`, the gradient of the loss sum is added to the tenant's accumulator."""
        fn = self._program(tenant.spec, loss, config, forward_only)
        args = (batch.input_ids, batch.targets, batch.valid, batch.inputs)
        if forward_only:
            logp, loss_sum = fn(tenant.params, self.rest, *args)
        else:
            tenant.grads, logp, loss_sum = fn(tenant.params, self.rest, tenant.grads, *args)
        return batch.per_row(np.asarray(logp)), float(loss_sum)

    def logprobs(self, spec: LoraSpec | None, params, rows: Sequence[TokenRow]) -> list[np.ndarray]:
        """Teacher-forced log-probs of each row's targets under `params` over the base (spec None: the base)."""
        batch = TokenBatch.pack(rows, (), self.max_len)
        key = ("logprobs", None if spec is None else spec.structure)
        fn = self._programs.get(key)
        if fn is None:
            graphdef = self.base_graphdef if spec is None else self._graphdef(spec)
            chunk = self.chunk

            def run(params, rest, ids, targets):
                model = nnx.merge(graphdef, rest) if params is None else nnx.merge(graphdef, params, rest)
                h = model.hidden_states(ids)[0]
                return logprobs_from_hidden(model, h, targets, chunk_size=chunk)

            fn = self._programs[key] = jax.jit(run)
        return batch.per_row(np.asarray(fn(params, self.rest, batch.input_ids, batch.targets)))

    def optim_step(self, tenant: Tenant, adam: AdamSettings) -> dict[str, float]:
        """One AdamW update from the accumulated gradients (module docstring); returns its metrics."""
        hp = {f.name: np.float32(getattr(adam, f.name)) for f in dataclasses.fields(AdamSettings)}
        tenant.params, tenant.opt_state, tenant.grads, metrics = self._update(tenant.params, tenant.opt_state,
                                                                              tenant.grads, hp)
        tenant.steps += 1
        return {k: float(v) for k, v in metrics.items()}

    def _program(self, spec: LoraSpec, loss: str, config: tuple, forward_only: bool):
        key = (spec.structure, loss, config, forward_only)
        fn = self._programs.get(key)
        if fn is None:
            fn = self._programs[key] = _build_step(self._graphdef(spec), loss, config, forward_only, self.chunk)
        return fn


def _build_step(graphdef, loss: str, config: tuple, forward_only: bool, chunk: int | None):
    """The jitted forward (log-probs, loss sum) or forward-backward (accumulator + gradient, log-probs, loss sum)."""
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; supported: {', '.join(LOSSES)}")

    def loss_of(params, rest, ids, targets, valid, inputs):
        model = nnx.merge(graphdef, params, rest)
        h = model.hidden_states(ids)[0]
        logp = logprobs_from_hidden(model, h, targets, chunk_size=chunk)
        return jnp.sum(token_loss(loss, logp, inputs, valid, config)), logp

    if forward_only:
        def forward(params, rest, ids, targets, valid, inputs):
            loss_sum, logp = loss_of(params, rest, ids, targets, valid, inputs)
            return logp, loss_sum

        return jax.jit(forward)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def step(params, rest, acc, ids, targets, valid, inputs):
        (loss_sum, logp), grads = grad_fn(params, rest, ids, targets, valid, inputs)
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        return acc, logp, loss_sum

    return jax.jit(step, donate_argnums=(2,))


def _committed(tree):
    return jax.device_put(tree, jax.tree.map(lambda x: x.sharding, tree))


def _like(saved, live):
    """`saved` (a nested dict of arrays, as `posttrain.training.checkpoint.tree_to_nested` writes, or a tree of the
    live structure) in the live tree's structure, dtypes and placement; a shape mismatch is a ValueError."""
    tree = nested_to_tree(saved, live) if isinstance(saved, dict) else saved

    def put(x, like):
        if tuple(np.shape(x)) != tuple(like.shape):
            raise ValueError(f"saved array of shape {tuple(np.shape(x))} where the model has {tuple(like.shape)}")
        return jax.device_put(np.asarray(x, dtype=like.dtype), like.sharding)

    return jax.tree.map(put, tree, live)


def random_seed() -> int:
    """A seed for a tenant that asked for none."""
    return secrets.randbits(31)

