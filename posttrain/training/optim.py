"""Optax optimizers (AdamW, SGD, Adafactor), warm-up + decay schedules and weight-decay masks.

Gradient accumulation is not done here (no `optax.MultiSteps`): the trainer accumulates micro-batch
gradients inside its jitted step, because the step's loss is normalised over the whole accumulated batch
(Σ loss_sum / Σ weight), which MultiSteps' average of per-micro-batch gradients cannot express, and one
compiled step per optimizer update needs no extra gradient buffer in the optimizer state.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax

from posttrain.models.weights import path_names
from posttrain.training.config import OptimConfig

__all__ = ["make_schedule", "decay_mask", "make_optimizer", "path_names"]


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """lr(step): linear warm-up 0 -> lr over `warmup_steps`, then cosine/linear/constant to lr*min_lr_ratio."""
    peak = cfg.lr
    end = cfg.lr * cfg.min_lr_ratio
    warm = min(cfg.warmup_steps, max(total_steps - 1, 0))
    decay_steps = max(total_steps - warm, 1)
    if cfg.decay == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio if peak else 0.0)
    elif cfg.decay == "linear":
        after = optax.linear_schedule(peak, end, decay_steps)
    elif cfg.decay == "constant":
        after = optax.constant_schedule(peak)
    else:
        raise ValueError(f"unknown decay {cfg.decay!r}; accepted: cosine, linear, constant")
    if warm <= 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm])


def _decays(names: list[str], leaf: Any, decay_embeddings: bool) -> bool:
    if any("norm" in n for n in names):  # RMSNorm weights: input_layernorm, q_norm, norm, ...
        return False
    if "bias" in names:
        return False
    if "embed_tokens" in names or "embedding" in names:
        return decay_embeddings
    return getattr(leaf, "ndim", 0) >= 1


def decay_mask(params, *, decay_embeddings: bool = False):
    """A pytree of bools over `params`: True where weight decay applies (not norms, biases, embeddings)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: _decays(path_names(p), x, decay_embeddings), params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optax transformation, schedule) for `cfg`: optional global-norm clipping, then the optimizer."""
    schedule = make_schedule(cfg, total_steps)
    mask: Callable = lambda p: decay_mask(p, decay_embeddings=cfg.decay_embeddings)  # noqa: E731
    if cfg.name == "adamw":
        tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask)
    elif cfg.name == "sgd":
        parts = []
        if cfg.weight_decay:
            parts.append(optax.add_decayed_weights(cfg.weight_decay, mask))
        parts.append(optax.sgd(schedule, momentum=cfg.momentum or None, nesterov=cfg.nesterov))
        tx = optax.chain(*parts)
    elif cfg.name == "adafactor":
        tx = optax.adafactor(schedule, weight_decay_rate=cfg.weight_decay or None, weight_decay_mask=mask)
    else:
        raise ValueError(f"unknown optimizer {cfg.name!r}; accepted: adamw, sgd, adafactor")
    if cfg.clip_norm and cfg.clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
    return tx, schedule
