"""Preference-optimisation losses (the DPO family) as small pure functions, and their typed presets.

Notation, per preference pair (prompt x, chosen y_w, rejected y_l):
  log π(y|x)   the policy's summed log-probability of the response tokens (`chosen_logps`, `rejected_logps`),
  log π_ref    the same under the frozen reference (`ref_chosen_logps`, `ref_rejected_logps`),
  Δ_w = log π(y_w|x) - log π_ref(y_w|x),  Δ_l likewise  (the implicit rewards are β Δ),
  h = Δ_w - Δ_l,  |y| the response length in tokens,  σ the logistic function.

Every function maps per-pair arrays [N] to per-pair losses [N]; the trainer averages them over the pairs
of the whole (accumulated) batch. The registry `PRESETS` maps a config name to a typed preset class whose
fields are the loss's hyper-parameters with their defaults (one source of truth), and whose `losses`
and `rewards` methods apply the pure function.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.algorithms.protocol import uses_frozen
from posttrain.algorithms.sft import (
    real_tokens,
    routes_experts,
    token_logprobs,
    with_router_terms,
)
from posttrain.models.moe_loss import RouterLoss

__all__ = [
    "dpo_sigmoid_loss", "ipo_loss", "hinge_loss", "robust_dpo_loss", "cdpo_loss", "simpo_loss",
    "orpo_odds_ratio_loss", "log1mexp", "PairLogps", "PreferenceLoss", "DPO", "IPO", "Hinge", "RobustDPO", "CDPO",
    "SimPO", "ORPO", "PRESETS", "make_preset", "ReferenceSource",
]


# ---------------------------------------------------------------------- pure functions
def dpo_sigmoid_loss(chosen_logratios, rejected_logratios, beta: float):
    """DPO (Rafailov et al. 2023, "Direct Preference Optimization", Eq. 7): -log σ(β (Δ_w - Δ_l))."""
    return -jax.nn.log_sigmoid(beta * (chosen_logratios - rejected_logratios))


def ipo_loss(chosen_logratios, rejected_logratios, chosen_lengths, rejected_lengths, beta: float):
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences",
    Eq. 17): (Δ_w / |y_w| - Δ_l / |y_l| - 1 / (2 β))², β being the paper's τ. The log-ratios are averaged
    per token (as TRL does, confirmed by the authors), so β does not depend on the response length."""
    cw = chosen_logratios / jnp.maximum(chosen_lengths, 1.0)
    cl = rejected_logratios / jnp.maximum(rejected_lengths, 1.0)
    return (cw - cl - 1.0 / (2.0 * beta)) ** 2


def hinge_loss(chosen_logratios, rejected_logratios, beta: float):
    """SLiC-HF hinge (Zhao et al. 2023, "SLiC-HF", Eq. 1 with δ = 1/β), as in DPO's appendix: max(0, 1 - β h)."""
    return jax.nn.relu(1.0 - beta * (chosen_logratios - rejected_logratios))


def robust_dpo_loss(chosen_logratios, rejected_logratios, beta: float, label_smoothing: float):
    """Robust DPO (Chowdhury et al. 2024, "Provably Robust DPO", Eq. 8) for preference labels flipped with
    probability ε: [(1-ε)(-log σ(β h)) - ε(-log σ(-β h))] / (1 - 2ε), an unbiased estimate of the clean loss."""
    h = beta * (chosen_logratios - rejected_logratios)
    e = label_smoothing
    return ((1.0 - e) * -jax.nn.log_sigmoid(h) - e * -jax.nn.log_sigmoid(-h)) / (1.0 - 2.0 * e)


def cdpo_loss(chosen_logratios, rejected_logratios, beta: float, label_smoothing: float):
    """Conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences & relationship to IPO"): DPO
    against labels smoothed by ε, -(1-ε) log σ(β h) - ε log σ(-β h)."""
    h = beta * (chosen_logratios - rejected_logratios)
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(h) - label_smoothing * jax.nn.log_sigmoid(-h)


def simpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, beta: float, gamma: float):
    """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", Eq. 6):
    -log σ(β/|y_w| log π(y_w|x) - β/|y_l| log π(y_l|x) - γ): reference-free, length-normalised, margin γ."""
    rw = beta * chosen_logps / jnp.maximum(chosen_lengths, 1.0)
    rl = beta * rejected_logps / jnp.maximum(rejected_lengths, 1.0)
    return -jax.nn.log_sigmoid(rw - rl - gamma)


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, accurate at both ends (Mächler 2012)."""
    return jnp.where(x > -0.6931471805599453, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def orpo_odds_ratio_loss(chosen_mean_logps, rejected_mean_logps, beta: float):
    """ORPO's odds-ratio term (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference
    Model", Eqs. 4-7): -λ log σ(log odds(y_w|x) - log odds(y_l|x)), odds(y|x) = P / (1 - P) with
    P = exp(mean token log-prob of y); λ = `beta`. The full ORPO loss adds the chosen response's NLL."""
    log_odds = (chosen_mean_logps - rejected_mean_logps) - (log1mexp(chosen_mean_logps) - log1mexp(rejected_mean_logps))
    return -beta * jax.nn.log_sigmoid(log_odds)


# ---------------------------------------------------------------------- typed presets
@dataclasses.dataclass
class PairLogps:
    """Per-pair sequence quantities [N] a preference loss reads (reference ones None when reference-free)."""

    chosen: jax.Array
    rejected: jax.Array
    chosen_lengths: jax.Array
    rejected_lengths: jax.Array
    ref_chosen: jax.Array | None = None
    ref_rejected: jax.Array | None = None

    def logratios(self):
        return self.chosen - self.ref_chosen, self.rejected - self.ref_rejected

    def mean_logps(self):
        return (self.chosen / jnp.maximum(self.chosen_lengths, 1.0),
                self.rejected / jnp.maximum(self.rejected_lengths, 1.0))


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
    """A preset of the DPO family: its fields are the hyper-parameters (with defaults), `losses` the per-pair
    loss and `rewards` the implicit rewards that metrics report (β Δ, or β × mean log-prob when reference-free).

    needs_reference: the loss reads reference log-probs. chosen_nll: add the chosen response's token NLL
    (ORPO).
    """

    name: ClassVar[str] = ""
    needs_reference: ClassVar[bool] = True
    chosen_nll: ClassVar[bool] = False
    beta: float = 0.1

    def __post_init__(self):
        if not self.beta > 0:
            raise ValueError(f"algorithm.beta must be > 0 for loss '{self.name}', found {self.beta}")

    def losses(self, p: PairLogps) -> jax.Array:
        raise NotImplementedError

    def rewards(self, p: PairLogps) -> tuple[jax.Array, jax.Array]:
        if self.needs_reference:
            cw, cl = p.logratios()
        else:
            cw, cl = p.mean_logps()
        return self.beta * cw, self.beta * cl


@dataclasses.dataclass(frozen=True)
class DPO(PreferenceLoss):
    name: ClassVar[str] = "sigmoid"
    beta: float = 0.1

    def losses(self, p):
        return dpo_sigmoid_loss(*p.logratios(), self.beta)


@dataclasses.dataclass(frozen=True)
class IPO(PreferenceLoss):
    name: ClassVar[str] = "ipo"
    beta: float = 0.1

    def losses(self, p):
        return ipo_loss(*p.logratios(), p.chosen_lengths, p.rejected_lengths, self.beta)


@dataclasses.dataclass(frozen=True)
class Hinge(PreferenceLoss):
    name: ClassVar[str] = "hinge"
    beta: float = 0.1

    def losses(self, p):
        return hinge_loss(*p.logratios(), self.beta)


def _check_smoothing(name: str, e: float, upper: float) -> None:
    if not 0.0 <= e < upper:
        raise ValueError(f"algorithm.label_smoothing must be in [0, {upper}) for loss '{name}', found {e}")


@dataclasses.dataclass(frozen=True)
class RobustDPO(PreferenceLoss):
    name: ClassVar[str] = "robust"
    beta: float = 0.1
    label_smoothing: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        _check_smoothing(self.name, self.label_smoothing, 0.5)

    def losses(self, p):
        return robust_dpo_loss(*p.logratios(), self.beta, self.label_smoothing)


@dataclasses.dataclass(frozen=True)
class CDPO(PreferenceLoss):
    name: ClassVar[str] = "cdpo"
    beta: float = 0.1
    label_smoothing: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        _check_smoothing(self.name, self.label_smoothing, 1.0)

    def losses(self, p):
        return cdpo_loss(*p.logratios(), self.beta, self.label_smoothing)


@dataclasses.dataclass(frozen=True)
class SimPO(PreferenceLoss):
    """SimPO's defaults follow the paper's recommended range (β 2.0-2.5, γ/β ≈ 0.5)."""

    name: ClassVar[str] = "simpo"
    needs_reference: ClassVar[bool] = False
    beta: float = 2.0
    gamma: float = 1.0

    def losses(self, p):
        return simpo_loss(p.chosen, p.rejected, p.chosen_lengths, p.rejected_lengths, self.beta, self.gamma)


@dataclasses.dataclass(frozen=True)
class ORPO(PreferenceLoss):
    """ORPO: the chosen NLL (added by the caller, `chosen_nll`) + the odds-ratio term with weight λ = beta."""

    name: ClassVar[str] = "orpo"
    needs_reference: ClassVar[bool] = False
    chosen_nll: ClassVar[bool] = True
    beta: float = 0.1

    def losses(self, p):
        return orpo_odds_ratio_loss(*p.mean_logps(), self.beta)


PRESETS: dict[str, type[PreferenceLoss]] = {c.name: c for c in (DPO, IPO, Hinge, RobustDPO, CDPO, SimPO, ORPO)}


def make_preset(name: str, **settings: Any) -> PreferenceLoss:
    """The preset `name` with the given settings (None = the preset's default); a setting the loss does not
    take, or an unknown name, is a ValueError naming the accepted ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown preference loss {name!r}; accepted: {sorted(PRESETS)}")
    cls = PRESETS[name]
    accepted = [f.name for f in dataclasses.fields(cls)]
    given = {k: v for k, v in settings.items() if v is not None}
    extra = sorted(set(given) - set(accepted))
    if extra:
        raise ValueError(f"algorithm.{extra[0]} does not apply to loss '{name}' (it takes: {', '.join(accepted)})")
    return cls(**given)


# ---------------------------------------------------------------------- the trainer's loss
class ReferenceSource(enum.StrEnum):
    """Where a preference loss's reference log-probs come from. The config's choice (`algorithm.reference`:
    auto/base/model) maps onto it once, in `posttrain.training.dpo.resolve_reference`."""

    PRECOMPUTED = "precomputed"  # batch["ref_logps"] [R], scored once before training
    BASE = "base"  # the LoRA base with adapters off (the trainer's frozen model "base")
    MODEL = "reference"  # a frozen model beside the trainer, named "reference"
    NONE = "none"  # reference-free losses

    @classmethod
    def of(cls, value) -> "ReferenceSource":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown reference source {value!r}; accepted: {list(REFERENCE_SOURCES)}") from None

    @property
    def frozen_name(self) -> str | None:
        """The trainer's frozen model that scores the reference in the step (None: none does)."""
        return self.value if self in (ReferenceSource.BASE, ReferenceSource.MODEL) else None


REFERENCE_SOURCES = tuple(r.value for r in ReferenceSource)


def sequence_logps(model, batch, chunk_size: int | None = None, routing: bool = False):
    """(Σ response-token log-probs [R], response lengths [R], token log-probs [R, T-1]) of every row of a
    preference batch; with `routing` (a mixture of experts) the pass's `moe.Routing` too."""
    out = token_logprobs(model, batch["input_ids"], attention_mask=batch.get("attention_mask"),
                         positions=batch.get("positions"), chunk_size=chunk_size, routing=routing)
    lp = out[0] if routing else out
    m = batch["loss_mask"][:, 1:].astype(jnp.float32)
    return (jnp.sum(lp * m, axis=-1), jnp.sum(m, axis=-1), lp) + ((out[1],) if routing else ())


def _reference_logps(batch, frozen, spec: PreferenceLoss, reference: ReferenceSource, chunk_size: int | None):
    """The reference's sequence log-probs [R]: precomputed in the batch, or scored by a frozen model."""
    if reference is ReferenceSource.PRECOMPUTED:
        return batch["ref_logps"].astype(jnp.float32)
    if reference.frozen_name is not None:
        return jax.lax.stop_gradient(sequence_logps(frozen[reference.frozen_name], batch, chunk_size)[0])
    raise ValueError(f"loss '{spec.name}' needs reference log-probs (reference={reference.value!r})")


def preference_loss(model, batch, frozen, *, spec: PreferenceLoss, reference: str = "reference",
                    chunk_size: int | None = None, nll_on_prompt: bool = False, router: RouterLoss | None = None):
    """The trainer's loss protocol for the DPO family over a batch of pairs (rows 2i chosen, 2i+1 rejected).

    Returns (Σ per-pair losses, number of real pairs, metrics). Reference log-probs come from
    `batch["ref_logps"]` [R] (`reference="precomputed"`), the LoRA base with adapters off ("base"), the
    frozen model "reference", or nowhere ("none", reference-free losses). ORPO adds the chosen NLL with
    per-row weights `batch["nll_weight"]` (see `nll_weights`): its token mean over the whole batch.
    Empty filler pairs (no response tokens) weigh nothing. A mixture of experts adds its router terms over the
    pass's real tokens (`router`, `posttrain.algorithms.sft.with_router_terms`), weighted by the pairs.
    """
    moe = routes_experts(model)
    logps, lengths, lp, *routing = sequence_logps(model, batch, chunk_size, routing=moe)
    ref = None
    if spec.needs_reference:
        ref = _reference_logps(batch, frozen, spec, ReferenceSource.of(reference), chunk_size)
    pair = lambda x: (x[0::2], x[1::2])  # noqa: E731  rows 2i, 2i+1
    (c, r), (lc, lr) = pair(logps), pair(lengths)
    p = PairLogps(c, r, lc, lr, *(pair(ref) if ref is not None else (None, None)))
    valid = ((lc > 0) & (lr > 0)).astype(jnp.float32)
    losses = spec.losses(p) * valid
    loss_sum = jnp.sum(losses)
    n = jnp.sum(valid)
    rc, rr = spec.rewards(p)
    mean = lambda x: (jnp.sum(jax.lax.stop_gradient(x) * valid), n)  # noqa: E731
    metrics = {
        "pairs": n,
        "rewards/chosen": mean(rc), "rewards/rejected": mean(rr), "rewards/margins": mean(rc - rr),
        "rewards/accuracies": mean((rc > rr).astype(jnp.float32)),
        "logps/chosen": mean(c), "logps/rejected": mean(r),
        "logps/accuracies": mean((c > r).astype(jnp.float32)),
    }
    if spec.chosen_nll:
        mask = (batch["attention_mask"] if nll_on_prompt else batch["loss_mask"])[:, 1:].astype(jnp.float32)
        row_nll = -jnp.sum(lp * mask, axis=-1)
        w = batch["nll_weight"].astype(jnp.float32)
        loss_sum = loss_sum + jnp.sum(row_nll * w)
        metrics["nll_loss"] = (jnp.sum(jax.lax.stop_gradient(row_nll)[0::2]), jnp.sum(mask[0::2]))
    if moe:
        real = real_tokens(batch["input_ids"], batch.get("attention_mask"))
        loss_sum, metrics = with_router_terms(router, model, routing[0], real, loss_sum, n, metrics)
    return loss_sum, n, metrics


def nll_weights(batch: dict, *, nll_on_prompt: bool = False):
    """Host-side row weights for ORPO's NLL over a whole (global) batch: real pairs / chosen NLL tokens on
    the chosen rows, 0 on the rejected ones; Σ weight x row NLL / pairs = the batch's token-mean NLL."""
    mask = np.asarray(batch["attention_mask"] if nll_on_prompt else batch["loss_mask"])[:, 1:]
    resp = np.asarray(batch["loss_mask"])[:, 1:].sum(-1)
    pairs = float(np.sum((resp[0::2] > 0) & (resp[1::2] > 0)))
    tokens = float(mask[0::2].sum())
    w = np.zeros(mask.shape[0], np.float32)
    w[0::2] = pairs / max(tokens, 1.0)
    return w


@dataclasses.dataclass(frozen=True)
class PreferenceLossFn:
    """`preference_loss` bound to its settings: hashable (the trainer's compile cache key), marked with the
    frozen models it needs and `rows_per_example=2` (a pair never splits across micro-batches)."""

    spec: PreferenceLoss
    reference: ReferenceSource = ReferenceSource.MODEL
    chunk_size: int | None = None
    nll_on_prompt: bool = False
    router: RouterLoss | None = None
    rows_per_example: ClassVar[int] = 2

    def __post_init__(self):
        object.__setattr__(self, "reference", ReferenceSource.of(self.reference))

    @property
    def names(self) -> tuple[str, ...]:
        name = self.reference.frozen_name
        return (name,) if self.spec.needs_reference and name is not None else ()

    def __call__(self, model, batch, frozen=None):
        return preference_loss(model, batch, frozen or {}, spec=self.spec, reference=self.reference,
                               chunk_size=self.chunk_size, nll_on_prompt=self.nll_on_prompt, router=self.router)


def make_preference_loss(spec: PreferenceLoss, *, reference: str = "reference", chunk_size: int | None = None,
                         nll_on_prompt: bool = False, router: RouterLoss | None = None):
    """The trainer loss for `spec` (a `uses_frozen` loss when it reads a frozen reference model); `router`: a
    mixture of experts' router terms."""
    reference = ReferenceSource.of(reference)
    fn = PreferenceLossFn(spec, reference if spec.needs_reference else ReferenceSource.NONE, chunk_size or None,
                          nll_on_prompt, router)
    return uses_frozen(fn, *fn.names, rows_per_example=2)
