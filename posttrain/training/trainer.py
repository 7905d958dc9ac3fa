"""The algorithm-agnostic trainer: train state, one jit-compiled step with gradient accumulation, log-probs.

An algorithm supplies a loss function (the *loss protocol*)::

    loss_fn(model, micro_batch) -> (loss_sum, weight, metrics)

`loss_sum` is an unnormalised scalar (e.g. the sum of masked token NLLs), `weight` its normaliser for
this micro-batch (e.g. the number of target tokens, or of sequences for sequence-mean RL modes), and
`metrics` a flat dict whose values are either a scalar (summed over micro-batches) or a pair
`(numerator, denominator)` (reported as Σ numerator / Σ denominator). `weight` must not depend on the
parameters.

`Trainer.step(batch)` splits the global batch (a dict of arrays with a leading batch axis) into
`grad_accum` micro-batches and runs them under `lax.scan` inside one compiled function, accumulating
the *unnormalised* gradients of `loss_sum` and the sums of `loss_sum` and `weight` in float32; at the
end the gradient is divided by Σ weight. The step's loss is therefore Σ loss_sum / Σ weight, a mean over
the real targets of the whole accumulated batch, and its gradient is exactly the gradient of that
globally normalised loss (not an average of per-micro-batch means). Micro-batch j takes rows
j, j + k, j + 2k, ... so that, with the batch sharded over the data axes, every device holds a slice of
every micro-batch.

Frozen models (a DPO reference, a distillation teacher) are held by the trainer without optimizer state
(`Trainer(frozen={"reference": model})` or `add_frozen`) and passed into the compiled step as *arguments*
(never closed-over constants, so they are not baked into the program and can be sharded and swapped). A
loss that uses them is wrapped with `uses_frozen(fn, "reference", ...)` and is called
`fn(model, micro_batch, frozen)` with `frozen` a dict of name -> model (no gradient flows into them).
The name "base" is always available on a LoRA model: the trained model with its adapters off (a DPO
reference without a second copy of the weights).

Rows that belong together (a DPO chosen/rejected pair, a group) stay in one micro-batch: with
`rows_per_example=g` (an argument of `step`, or the loss's attribute of that name) the batch is read as
B/g examples of g consecutive rows, and micro-batch j takes examples j, j + k, j + 2k, ... whole.

The model is split once (`nnx.split`) into a static graph definition, the trained parameters (`wrt`:
all `nnx.Param`s, or only the `nnx.LoRAParam` adapters when the model has LoRA) and the rest (frozen
weights, quantised kernels); the step is a pure function of (params, optimizer state, rest, batch, step)
with params and optimizer state donated. An update whose loss or gradient norm is not finite, or whose
batch has no weight, is not applied (the parameters stay as they were) and is flagged in the metrics
(`skipped`), so a divergence can never reach a checkpoint. With a mesh, every parameter is placed by its
logical axes (`posttrain.distributed`) and each batch is sharded over (data, fsdp).

Float16 training scales the loss (`loss_scale`, `posttrain.training.loss_scale`): each micro-batch differentiates
loss_sum * S / weight (the scale S on its mean loss) and its float32 gradients are multiplied back by weight / S
before they are summed; an overflowing step is skipped as above, the scale adjusted, and the metrics report
`loss_scale`, `loss_scale/overflow` (this step) and `loss_scale/overflows` (so far).

Multi-host: the mesh spans every process's devices and every process runs the same steps. A batch is
either the whole global batch on every process (RL: each process holds all rollouts) or, with
`process_local_batches`, this process's rows of it (SFT: each process reads its own share of the data,
`posttrain.distributed.process_batch_rows`), assembled with `jax.make_array_from_process_local_data`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from posttrain import distributed
from posttrain.algorithms.protocol import LossFn, UsesFrozen, reduce_metrics, uses_frozen
from posttrain.algorithms.sft import token_logprobs
from posttrain.models import lora as lora_lib
from posttrain.models.weights import path_names
from posttrain.training.loss_scale import LossScale

__all__ = ["FrozenModels", "LossFn", "Programs", "SplitModel", "StepSettings", "TrainState", "Trainer", "UsesFrozen",
           "flops_per_token", "reduce_metrics", "uses_frozen"]


def _as_f32(tree):
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token for MFU (PaLM, Chowdhery et al. 2022, app. B): 6 N + 12 L H Q T.

    N counts the parameters of matrix multiplies (every layer's linear maps and the output head; not
    the embedding lookup or the norms), L layers, H query heads of size Q, T the sequence length (the
    attention score and value products, forward and backward).
    """
    n = cfg.num_layers * cfg.layer_matmul_params() + cfg.vocab_size * cfg.hidden_size
    return 6.0 * n + 12.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """How every step runs: the optimizer and the schedule it reports as `lr`, micro-batches per step, the mesh
    (None: the default device), tokens per vocabulary chunk of the log-prob programs, donated buffers, and
    whether batches hold only this process's rows (multi-host data loading)."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule | None = None
    grad_accum: int = 1
    mesh: Mesh | None = None
    logprob_chunk_size: int | None = None
    donate: bool = True
    process_local_batches: bool = False


@dataclasses.dataclass
class TrainState:
    """What a checkpoint holds: the trained parameters, the optimizer state, the step count, the RNG key data, and
    the loss scale of float16 training (`posttrain.training.loss_scale`; None: no scaling)."""

    params: Any
    opt_state: Any
    step: int
    rng: jax.Array
    loss_scale: LossScale | None = None


@dataclasses.dataclass(frozen=True)
class SplitModel:
    """The model split once (`nnx.split`): its graph definition (and the one with LoRA adapters off), which
    variables are trained (`wrt`), the rest (frozen weights, quantised kernels), the model's config, and the
    shardings the parameters and optimizer state keep through every step and restore."""

    graphdef: Any
    graphdef_base: Any
    rest: Any
    wrt: Any
    has_lora: bool
    cfg: Any
    param_shardings: Any
    opt_shardings: Any


@dataclasses.dataclass
class Programs:
    """The compiled programs, by what they were built for: steps by (loss, rows per example), evaluations by
    loss, log-prob functions by (adapters, last) or ("frozen", name, last)."""

    steps: dict[Any, Callable] = dataclasses.field(default_factory=dict)
    evals: dict[Any, Callable] = dataclasses.field(default_factory=dict)
    logprobs: dict[tuple, Callable] = dataclasses.field(default_factory=dict)

    def forget_frozen(self, name: str | None = None) -> None:
        """Drops the programs that take the frozen models as arguments (their set changed): steps and
        evaluations, and the log-prob function of the frozen model `name`."""
        self.steps.clear()
        self.evals.clear()
        if name is not None:
            self.logprobs = {k: v for k, v in self.logprobs.items() if k[:2] != ("frozen", name)}


@dataclasses.dataclass
class FrozenModels:
    """Frozen models by name, split: graph definitions and states (the states are arguments of the programs)."""

    graphdefs: dict[str, Any] = dataclasses.field(default_factory=dict)
    states: dict[str, Any] = dataclasses.field(default_factory=dict)


def _field(record: str, name: str, *, settable: bool = False) -> property:
    """A Trainer attribute that reads (and, if `settable`, writes) the field `name` of its record `record`."""

    def get(self):
        return getattr(getattr(self, record), name)

    def put(self, value):
        setattr(getattr(self, record), name, value)

    return property(get, put if settable else None, doc=f"`{record}.{name}`")


def _init_state(settings: StepSettings, params, seed: int):
    """The optimizer state and the RNG key data of a fresh run, made by one compiled program (not one small
    program per leaf, as the eager `tx.init` would), committed to their devices as the parameters are. With a mesh,
    optimizer moments take their parameter's sharding and the other leaves (counts, the key) are replicated."""
    tx, mesh = settings.tx, settings.mesh

    def init_train_state(params):
        return tx.init(params), jax.random.key_data(jax.random.key(seed))

    if mesh is None:
        return jax.jit(init_train_state, out_shardings=jax.tree.leaves(params)[0].sharding)(params)
    abstract = jax.eval_shape(tx.init, params)
    flat_params = {tuple(p): x for p, x in _flat_with_names(params)}
    rep = NamedSharding(mesh, PartitionSpec())

    def pick(path, leaf):
        names = tuple(path_names(path))
        # An optimizer-state leaf whose path ends with a parameter's path mirrors that parameter.
        for n in range(len(names)):
            x = flat_params.get(names[n:])
            if x is not None and x.shape == leaf.shape:
                return x.sharding
        return rep

    shardings = jax.tree_util.tree_map_with_path(pick, abstract)
    return jax.jit(init_train_state, out_shardings=(shardings, rep))(params)


class Trainer:
    """Train state (params, optimizer state, step, RNG) and the compiled step of any loss function.

    Args:
      model: an NNX model (e.g. `posttrain.models.Transformer`), with LoRA adapters attached or not.
      tx: an optax transformation (see `posttrain.training.optim.make_optimizer`).
      loss_fn: the default loss (protocol above); `step(batch, loss_fn=...)` can run any other.
      grad_accum: micro-batches per step; the global batch size must be divisible by it.
      mesh: a (data, fsdp, tensor) mesh, or None for the default device.
      wrt: which variables are trained (default: LoRA adapters if attached, else every `nnx.Param`).
      schedule: the learning-rate schedule, only to report `lr` in the metrics.
      seed: seeds the train state's RNG key (checkpointed; `next_rng()` hands out per-step keys).
      logprob_chunk_size: tokens per vocabulary-projection chunk in `token_logprobs` (None = whole).
      frozen: name -> model held frozen (no optimizer state) for losses marked with `uses_frozen`.
      process_local_batches: batches hold only this process's rows of the global batch (multi-host data
        loading); otherwise every process passes the whole batch.
      loss_scale: the loss scale of float16 training (`posttrain.training.loss_scale.LossScale`: the loss is scaled
        before the backward pass, the gradients unscaled, an overflowing step skipped; checkpointed); None: none.

    Its state lives in small records: `settings` (`StepSettings`), `split` (`SplitModel`), `state`
    (`TrainState`), `programs` (`Programs`) and `frozen` (`FrozenModels`); the attributes below read them.
    """

    mesh = _field("settings", "mesh")
    grad_accum = _field("settings", "grad_accum")
    logprob_chunk_size = _field("settings", "logprob_chunk_size")
    process_local_batches = _field("settings", "process_local_batches")
    graphdef = _field("split", "graphdef")
    graphdef_base = _field("split", "graphdef_base")
    rest = _field("split", "rest")
    has_lora = _field("split", "has_lora")
    cfg = _field("split", "cfg")
    params = _field("state", "params", settable=True)
    opt_state = _field("state", "opt_state", settable=True)
    step_count = _field("state", "step", settable=True)
    rng = _field("state", "rng", settable=True)
    loss_scale = _field("state", "loss_scale", settable=True)
    frozen_graphdefs = _field("frozen", "graphdefs")
    frozen_states = _field("frozen", "states")

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *, loss_fn: LossFn | None = None,
                 grad_accum: int = 1, mesh: Mesh | None = None, wrt=None, schedule: optax.Schedule | None = None,
                 seed: int = 0, logprob_chunk_size: int | None = None, donate: bool = True,
                 frozen: dict[str, nnx.Module] | None = None, process_local_batches: bool = False,
                 loss_scale: LossScale | None = None):
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, found {grad_accum}")
        self.loss_fn = loss_fn
        self.settings = StepSettings(
            tx=tx, schedule=schedule, grad_accum=int(grad_accum), mesh=mesh, logprob_chunk_size=logprob_chunk_size,
            donate=donate, process_local_batches=process_local_batches and mesh is not None and jax.process_count() > 1)
        has_lora = lora_lib.has_lora(model)
        wrt = wrt if wrt is not None else (nnx.LoRAParam if has_lora else nnx.Param)
        if mesh is not None:
            distributed.shard_model(model, mesh)
        graphdef, params, rest = nnx.split(model, wrt, ...)
        graphdef_base = graphdef
        if has_lora:
            with lora_lib.disabled(model):
                graphdef_base = nnx.split(model, wrt, ...)[0]
        if not jax.tree.leaves(params):
            raise ValueError(f"the model has no trainable parameters of kind {wrt}")
        if mesh is None:  # committed to their device as restored arrays are: a restore keeps the step's signature
            params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, params))
        opt_state, rng = _init_state(self.settings, params, seed)
        self.state = TrainState(params=params, opt_state=opt_state, step=0, rng=rng)
        sharding = lambda x: x.sharding  # noqa: E731
        self.split = SplitModel(graphdef=graphdef, graphdef_base=graphdef_base, rest=rest, wrt=wrt, has_lora=has_lora,
                                cfg=getattr(model, "cfg", None), param_shardings=jax.tree.map(sharding, params),
                                opt_shardings=jax.tree.map(sharding, opt_state))
        self.loss_scale = self._placed(loss_scale)
        self.programs = Programs()
        self.frozen = FrozenModels()
        for name, m in (frozen or {}).items():
            self.add_frozen(name, m)

    def add_frozen(self, name: str, model: nnx.Module) -> None:
        """Holds `model` frozen under `name` (placed on the mesh; no optimizer state, not checkpointed: it
        comes back from its own checkpoint). Its state is an argument of every step whose loss uses it."""
        if name == "base":
            raise ValueError("'base' names the LoRA model with adapters off; choose another name")
        if self.mesh is not None:
            distributed.shard_model(model, self.mesh)
        self.frozen.graphdefs[name], self.frozen.states[name] = nnx.split(model)
        self.programs.forget_frozen()

    def remove_frozen(self, name: str) -> None:
        """Drops the frozen model `name` (frees its memory once nothing else holds it)."""
        self.frozen.states.pop(name)
        self.frozen.graphdefs.pop(name)
        self.programs.forget_frozen(name)

    def _frozen_args(self, loss_fn) -> dict[str, Any]:
        """The frozen states a loss needs (the arguments of its compiled step)."""
        names = getattr(loss_fn, "names", None) if isinstance(loss_fn, UsesFrozen) else None
        out = {}
        for n in names or ():
            if n == "base":
                if not self.has_lora:
                    raise ValueError("the frozen model 'base' (adapters off) needs a LoRA model")
                continue
            if n not in self.frozen.states:
                raise ValueError(f"the loss needs the frozen model {n!r}; the trainer holds "
                                 f"{sorted(self.frozen.states) or 'none'} (add it with add_frozen)")
            out[n] = self.frozen.states[n]
        return out

    def _call_loss(self, loss_fn, model, params, rest, frozen_states, mb):
        """Calls a loss with its frozen models rebuilt from their states (no gradients into them)."""
        if not isinstance(loss_fn, UsesFrozen):
            return loss_fn(model, mb)
        frozen = {n: nnx.merge(self.frozen.graphdefs[n], jax.lax.stop_gradient(st)) for n, st in frozen_states.items()}
        if "base" in loss_fn.names:
            frozen["base"] = nnx.merge(self.graphdef_base, jax.lax.stop_gradient(params), rest)
        return loss_fn(model, mb, frozen)

    # ------------------------------------------------------------------ state
    @property
    def num_trainable(self) -> int:
        return int(sum(math.prod(x.shape) for x in jax.tree.leaves(self.params)))

    def model(self, *, adapters: bool = True) -> nnx.Module:
        """A model object over the current weights. It shares the trainer's Variables (setting a value on it
        changes the trainer's state) and its arrays are donated by the next `step`: use it, then step."""
        return nnx.merge(self.graphdef if adapters else self.graphdef_base, self.params, self.rest)

    def next_rng(self) -> jax.Array:
        """A fresh PRNG key from the train state's key (the key is advanced and checkpointed)."""
        key = jax.random.wrap_key_data(self.rng)
        key, sub = jax.random.split(key)
        self.rng = jax.random.key_data(key)
        return sub

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds: trained params, optimizer state, step, RNG key (and the loss scale, if any)."""
        out = {"params": self.params, "opt_state": self.opt_state,
               "step": np.asarray(self.step_count, np.int64), "rng": np.asarray(self.rng)}
        if self.loss_scale is not None:
            out["loss_scale"] = self.loss_scale.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Puts a checkpoint's state in place, each tree in its live shardings (transfers, nothing compiled)."""
        self.params = jax.device_put(state["params"], self.split.param_shardings)
        self.opt_state = jax.device_put(state["opt_state"], self.split.opt_shardings)
        self.step_count = int(state["step"])
        self.rng = jax.device_put(np.asarray(state["rng"], np.uint32))
        if self.loss_scale is not None:
            self.loss_scale = self._placed(self.loss_scale.load(state["loss_scale"]))

    def _placed(self, loss_scale: LossScale | None) -> LossScale | None:
        """A loss scale on the devices as the step returns it (replicated), so that the step's signature never
        changes (a fresh or restored one compiles nothing new)."""
        if loss_scale is None:
            return None
        rep = (NamedSharding(self.mesh, PartitionSpec()) if self.mesh is not None
               else jax.tree.leaves(self.params)[0].sharding)
        return jax.device_put(loss_scale, rep)

    # ------------------------------------------------------------------ batches
    def put_batch(self, batch):
        """Moves a host batch (a dict of arrays, or a typed pytree of them such as `RLBatch`; None fields stay
        None) to the devices (sharded over data+fsdp when a mesh is set); plain transfers, nothing compiled."""
        mesh = self.mesh
        if mesh is None:
            return _map_arrays(_to_device, batch)
        if self.process_local_batches:  # this process's rows -> the global array (every process calls this)
            n = jax.process_count()
            return _map_arrays(lambda v: jax.make_array_from_process_local_data(
                distributed.batch_sharding(mesh, np.ndim(v)), np.asarray(v),
                (np.shape(v)[0] * n, *np.shape(v)[1:])), batch)
        return _map_arrays(lambda v: jax.device_put(np.asarray(v), distributed.batch_sharding(mesh, np.ndim(v))), batch)

    def _split(self, x: jax.Array, rows_per_example: int = 1) -> jax.Array:
        """[B, ...] -> [k, B/k, ...] with micro-batch j = examples j, j+k, j+2k, ... (an example = g consecutive
        rows, g = rows_per_example; g = 1: rows j, j+k, ...)."""
        k, g = self.grad_accum, rows_per_example
        e = x.shape[0] // g
        y = x.reshape(e // k, k, g, *x.shape[1:]).swapaxes(0, 1).reshape(k, (e // k) * g, *x.shape[1:])
        if self.mesh is not None:
            spec = distributed.logical_to_spec((None, "batch") + (None,) * (x.ndim - 1), y.shape, self.mesh)
            y = jax.lax.with_sharding_constraint(y, NamedSharding(self.mesh, spec))
        return y

    # ------------------------------------------------------------------ the step
    def _grads(self, grad_fn, micro, params, rest, frozen, batch, rows_per_example: int, loss_scale):
        """Σ over the micro-batches of (loss_sum, weight, metrics) and of the float32 gradients of loss_sum (each
        micro-batch's differentiated scaled by `loss_scale`, then unscaled here: `LossScale.factor`)."""
        if self.grad_accum == 1:
            (_, (loss_sum, weight, metrics, f)), grads = grad_fn(params, rest, frozen, batch, loss_scale)
            return jax.tree.map(lambda g: g.astype(jnp.float32) / f, grads), loss_sum, weight, metrics
        mbs = jax.tree.map(lambda x: self._split(x, rows_per_example), batch)
        first = jax.tree.map(lambda x: x[0], mbs)
        _, (_, w_shape, m_shape, _) = jax.eval_shape(micro, params, rest, frozen, first, loss_scale)
        zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), t)  # noqa: E731
        init = (zeros(jax.eval_shape(lambda p: p, params)), jnp.zeros((), jnp.float32), zeros(w_shape), zeros(m_shape))

        def body(carry, mb):
            g_acc, l_acc, w_acc, m_acc = carry
            (_, (ls, w, m, f)), g = grad_fn(params, rest, frozen, mb, loss_scale)
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32) / f, g_acc, g)
            m_acc = jax.tree.map(jnp.add, m_acc, m)
            return (g_acc, l_acc + ls, w_acc + w, m_acc), None

        (grads, loss_sum, weight, metrics), _ = jax.lax.scan(body, init, mbs)
        return grads, loss_sum, weight, metrics

    def _build_step(self, loss_fn: LossFn, rows_per_example: int = 1):
        graphdef, tx, schedule = self.graphdef, self.settings.tx, self.settings.schedule

        def micro(params, rest, frozen, mb, loss_scale):
            model = nnx.merge(graphdef, params, rest)
            loss_sum, weight, metrics = self._call_loss(loss_fn, model, params, rest, frozen, mb)
            loss_sum, weight = jnp.asarray(loss_sum, jnp.float32), jnp.asarray(weight, jnp.float32)
            # differentiated: the loss times the loss scale's factor (1 without one); reported: the loss itself
            f = 1.0 if loss_scale is None else loss_scale.factor(weight)
            return loss_sum * f, (loss_sum, weight, _as_f32(metrics), f)

        grad_fn = jax.value_and_grad(micro, has_aux=True)

        def step_fn(params, opt_state, rest, frozen, batch, step, loss_scale=None):
            grads, loss_sum, weight, metrics = self._grads(grad_fn, micro, params, rest, frozen, batch,
                                                           rows_per_example, loss_scale)
            denom = jnp.maximum(weight, 1e-12)
            grads = jax.tree.map(lambda g: g / denom, grads)
            loss = loss_sum / denom
            grad_norm = optax.tree.norm(grads)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
            updates, new_opt = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (weight > 0)
            new_params = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_params, params)
            new_opt = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_opt, opt_state)
            out = {"loss": loss, "grad_norm": grad_norm, "weight": weight, "tokens": _real_tokens(batch),
                   "skipped": 1.0 - ok.astype(jnp.float32),
                   "lr": jnp.asarray(schedule(step) if schedule is not None else 0.0, jnp.float32)}
            if loss_scale is not None:  # an overflow: skipped (above), the scale adjusted, counted
                finite = jnp.isfinite(grad_norm)
                out |= {"loss_scale": loss_scale.scale, "loss_scale/overflow": 1.0 - finite.astype(jnp.float32)}
                loss_scale = loss_scale.adjust(finite)
                out["loss_scale/overflows"] = loss_scale.overflows.astype(jnp.float32)
            for name, v in reduce_metrics(metrics).items():
                out.setdefault(name, v)
            return new_params, new_opt, loss_scale, out

        kwargs = {}
        if self.settings.donate:
            kwargs["donate_argnums"] = (0, 1)
        if self.mesh is not None:
            rep = NamedSharding(self.mesh, PartitionSpec())
            kwargs["out_shardings"] = (self.split.param_shardings, self.split.opt_shardings, rep, rep)
        return jax.jit(step_fn, **kwargs)

    def _check_batch(self, batch, rows_per_example: int = 1):
        arrays = _named_arrays(batch)
        sizes = {np.shape(v)[0] for v in arrays.values()}
        if len(sizes) != 1:
            shapes = {k: np.shape(v) for k, v in arrays.items()}
            raise ValueError(f"batch arrays disagree on the batch size: {shapes}")
        b = sizes.pop() * (jax.process_count() if self.process_local_batches else 1)
        if b % rows_per_example:
            raise ValueError(f"batch size {b} is not a whole number of examples of {rows_per_example} rows")
        if (b // rows_per_example) % self.grad_accum:
            what = f"{b // rows_per_example} examples" if rows_per_example > 1 else f"batch size {b}"
            raise ValueError(f"{what} is not divisible by grad_accum={self.grad_accum}")
        return b

    def step(self, batch: dict[str, Any], loss_fn: LossFn | None = None, *, fetch: bool = True,
             rows_per_example: int | None = None) -> dict[str, Any]:
        """One optimizer update on `batch`; returns metrics (floats when `fetch`, device scalars otherwise).

        Metrics: loss (Σ loss_sum / Σ weight), grad_norm (before clipping), lr, weight, tokens (real
        tokens by attention_mask), skipped (1 if the update was not applied), plus the loss's own.
        rows_per_example: consecutive rows that stay in one micro-batch (default: the loss's attribute, or 1).
        """
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise ValueError("no loss function: pass loss_fn to Trainer(...) or to step(...)")
        g = int(rows_per_example or getattr(loss_fn, "rows_per_example", 1) or 1)
        self._check_batch(batch, g)
        fn = self.programs.steps.get((loss_fn, g))
        if fn is None:
            fn = self.programs.steps[(loss_fn, g)] = self._build_step(loss_fn, g)
        dev = self.put_batch(batch)
        self.params, self.opt_state, self.loss_scale, metrics = distributed.call_compiled(  # compiled by all first
            fn, self.params, self.opt_state, self.rest, self._frozen_args(loss_fn), dev,
            np.int32(self.step_count), self.loss_scale)  # numpy scalars: transferred (jnp.asarray would compile a cast)
        self.step_count += 1
        if fetch:
            return {k: float(v) for k, v in distributed.to_host(metrics).items()}
        return metrics

    # ------------------------------------------------------------------ evaluation and log-probs
    def eval_step(self, batch: dict[str, Any], loss_fn: LossFn | None = None) -> tuple[float, float]:
        """(Σ loss_sum, Σ weight) of `batch` under the current weights, without updating anything."""
        ls, w, _ = self.eval_sums(batch, loss_fn)
        return ls, w

    def eval_sums(self, batch: dict[str, Any], loss_fn: LossFn | None = None) -> tuple[float, float, dict[str, Any]]:
        """(Σ loss_sum, Σ weight, metrics) of `batch` without updating anything; metrics as the loss returns
        them (a scalar, or a (numerator, denominator) pair), as floats: sum them over batches, then
        `reduce_metrics`."""
        loss_fn = loss_fn or self.loss_fn
        fn = self.programs.evals.get(loss_fn)
        if fn is None:
            graphdef = self.graphdef

            def eval_fn(params, rest, frozen, b):
                model = nnx.merge(graphdef, params, rest)
                ls, w, m = self._call_loss(loss_fn, model, params, rest, frozen, b)
                return jnp.asarray(ls, jnp.float32), jnp.asarray(w, jnp.float32), _as_f32(m)

            fn = self.programs.evals[loss_fn] = jax.jit(eval_fn)
        ls, w, m = distributed.to_host(distributed.call_compiled(fn, self.params, self.rest, self._frozen_args(loss_fn),
                                                                 self.put_batch(batch)))
        m = {k: (tuple(float(x) for x in v) if isinstance(v, (tuple, list)) else float(v)) for k, v in m.items()}
        return float(ls), float(w), m

    def logprob_fn(self, *, adapters: bool = True, last: int | None = None) -> Callable:
        """The jitted pure function (params, rest, input_ids, attention_mask, positions, segment_ids[,
        pixel_values]) -> [B, T-1] per-token log-probs (chunked log-softmax), or [B, last] for the last `last`
        tokens only (the vocabulary projected at those positions only); `adapters=False` gives the base model.
        pixel_values: a vision-language batch's images [B, M, C, H, W] (None: text)."""
        fn = self.programs.logprobs.get((adapters, last))
        if fn is None:
            graphdef = self.graphdef if adapters else self.graphdef_base
            chunk = self.logprob_chunk_size

            def lp(params, rest, input_ids, attention_mask, positions, segment_ids, pixel_values=None):
                model = nnx.merge(graphdef, params, rest)
                return token_logprobs(model, input_ids, attention_mask=attention_mask, positions=positions,
                                      segment_ids=segment_ids, chunk_size=chunk, last=last,
                                      pixel_values=pixel_values)

            fn = self.programs.logprobs[(adapters, last)] = jax.jit(lp)
        return fn

    def frozen_token_logprobs(self, name: str, batch: dict[str, Any], *, last: int | None = None) -> jax.Array:
        """Per-token log-probs [B, T-1] (or [B, last]) of the frozen model `name` ("base": the LoRA model with
        adapters off), e.g. to precompute a DPO reference once."""
        if name == "base":
            return self.token_logprobs(batch, adapters=False, last=last)
        key = ("frozen", name, last)
        fn = self.programs.logprobs.get(key)
        if fn is None:
            graphdef, chunk = self.frozen.graphdefs[name], self.logprob_chunk_size

            def lp(state, input_ids, attention_mask, positions, segment_ids):
                return token_logprobs(nnx.merge(graphdef, state), input_ids, attention_mask=attention_mask,
                                      positions=positions, segment_ids=segment_ids, chunk_size=chunk, last=last)

            fn = self.programs.logprobs[key] = jax.jit(lp)
        dev = self.put_batch(batch)
        return fn(self.frozen.states[name], dev["input_ids"], dev.get("attention_mask"), dev.get("positions"),
                  dev.get("segment_ids"))

    def token_logprobs(self, batch: dict[str, Any], *, adapters: bool = True, params=None,
                       last: int | None = None) -> jax.Array:
        """log p(input_ids[:, t+1] | ..t) [B, T-1] under the current (or given) params; `adapters=False`
        (LoRA models) scores with the adapters switched off: the base model, RL's reference policy.

        `last` = C returns only the last C tokens' log-probs [B, C], projecting the vocabulary at those
        positions only: for an RL batch (`posttrain.rl.batch.RLBatch`), `last=batch.completion_len`
        gives the completion columns directly (what `completion_logprobs` slices out of the full result).
        """
        dev = self.put_batch(batch)  # read it with `distributed.to_host` (a collective with several processes)
        return self.logprob_fn(adapters=adapters, last=last)(
            self.params if params is None else params, self.rest, dev["input_ids"], dev.get("attention_mask"),
            dev.get("positions"), dev.get("segment_ids"), dev.get("pixel_values"))


# ---------------------------------------------------------------------- helpers
def _map_arrays(fn, batch):
    """`fn` over a batch's arrays: a dict's values (as they are), or the array leaves of a typed pytree batch."""
    if isinstance(batch, dict):
        return {k: fn(v) for k, v in batch.items()}
    return jax.tree.map(fn, batch)


def _named_arrays(batch) -> dict[str, Any]:
    """A batch's arrays by name: a dict as it is, a typed pytree batch's non-None fields by field name."""
    if isinstance(batch, dict):
        return batch
    return {jax.tree_util.keystr(path, simple=True, separator="."): v
            for path, v in jax.tree_util.tree_flatten_with_path(batch)[0]}


def _to_device(v):
    """A host array on the default device by a plain transfer (`jnp.asarray` compiles a program per shape)."""
    return v if isinstance(v, jax.Array) else jax.device_put(np.asarray(v))


def _real_tokens(batch) -> jax.Array:
    """The batch's real tokens (by attention_mask; all of input_ids without one), in the compiled step."""
    arrays = _named_arrays(batch)
    if "attention_mask" in arrays:
        return jnp.sum(arrays["attention_mask"].astype(jnp.float32))
    return jnp.asarray(math.prod(arrays["input_ids"].shape), jnp.float32)


def _flat_with_names(tree):
    return [(path_names(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]

