"""Knowledge-distillation losses: per-token divergences between a teacher and a student, as pure functions.

Notation, per token position: p = softmax(z_teacher / T) the teacher's distribution, q = softmax(z_student / T)
the student's (T the temperature), over the vocabulary or over the teacher's top-k support (below).

    forward_kl   KL(p || q) = Σ_v p_v (log p_v - log q_v)          mean-seeking; Hinton et al. 2015,
                                                                     "Distilling the Knowledge in a Neural Network"
    reverse_kl   KL(q || p) = Σ_v q_v (log q_v - log p_v)          mode-seeking (MiniLLM, Gu et al. 2024)
    jsd (beta)   m = beta p + (1 - beta) q,
                 JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m)  generalised JSD of GKD (Agarwal et al.
                 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
                 eq. 1); as TRL's GKD, beta = 0 is forward_kl and beta = 1 reverse_kl exactly

Temperature: the divergence of the softened distributions is multiplied by T^2 (Hinton et al. 2015, sec. 2:
the soft targets' gradients scale as 1/T^2, so the product keeps their magnitude when T changes).

Mixed loss per target token (Hinton et al.'s weighted average of the two objectives):

    l_t = alpha * T^2 * D(p_t, q_t) + (1 - alpha) * CE_t,    CE_t = -log q^{T=1}(y_t)  (the data's next token)

Top-k (a precomputed teacher): only the teacher's k most likely tokens S_k and their log-probabilities at
temperature T, log p_v for v in S_k, are kept. The loss on that support is well defined in one of two ways:

  renormalised (default): both distributions are renormalised over S_k, p~ = p[S_k] / Σ_{S_k} p and
    q~ = q[S_k] / Σ_{S_k} q (i.e. softmax of the logits restricted to S_k), and D is taken between p~ and q~:
    a proper divergence between two distributions on the same k outcomes, zero iff the student's conditional
    distribution on S_k is the teacher's, equal to the full loss when k = V. The student's mass outside S_k
    is not penalised (the cross-entropy term, alpha < 1, still trains the full softmax).
  tail: k + 1 outcomes, the k tokens and "any other token" with the rest of the mass, p_rest = 1 - Σ_{S_k} p
    (known exactly because the stored values are normalised log-probs) and q_rest = 1 - Σ_{S_k} q: the
    divergence between the two distributions coarse-grained to that partition, never more than the full
    divergence and equal to it when k = V; it does penalise student mass outside S_k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["forward_kl", "reverse_kl", "generalized_jsd", "DIVERGENCES", "divergence", "token_divergence",
           "topk_token_divergence", "teacher_topk", "distill_token_loss"]


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def forward_kl(student_logp: jax.Array, teacher_logp: jax.Array, beta: float | None = None) -> jax.Array:
    """KL(p || q) = Σ_v p_v (log p_v - log q_v) over the last axis (p teacher, q student); log-probs in."""
    t = _f32(teacher_logp)
    return jnp.sum(jnp.exp(t) * (t - _f32(student_logp)), axis=-1)


def reverse_kl(student_logp: jax.Array, teacher_logp: jax.Array, beta: float | None = None) -> jax.Array:
    """KL(q || p) = Σ_v q_v (log q_v - log p_v) over the last axis (q student, p teacher); log-probs in."""
    s = _f32(student_logp)
    return jnp.sum(jnp.exp(s) * (s - _f32(teacher_logp)), axis=-1)


def generalized_jsd(student_logp: jax.Array, teacher_logp: jax.Array, beta: float = 0.5) -> jax.Array:
    """GKD's generalised JSD (Agarwal et al. 2024, eq. 1): with m = beta p + (1 - beta) q,
    beta KL(p || m) + (1 - beta) KL(q || m); beta = 0 -> KL(p || q), beta = 1 -> KL(q || p) (TRL's convention)."""
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must be in [0, 1], found {beta}")
    if beta == 0.0:
        return forward_kl(student_logp, teacher_logp)
    if beta == 1.0:
        return reverse_kl(student_logp, teacher_logp)
    s, t = _f32(student_logp), _f32(teacher_logp)
    log_m = jnp.logaddexp(s + jnp.log1p(-beta), t + jnp.log(beta))
    kl_p_m = jnp.sum(jnp.exp(t) * (t - log_m), axis=-1)
    kl_q_m = jnp.sum(jnp.exp(s) * (s - log_m), axis=-1)
    return beta * kl_p_m + (1.0 - beta) * kl_q_m


#: config name -> divergence(student_logp, teacher_logp, beta) over the last axis
DIVERGENCES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": generalized_jsd}


def divergence(name: str):
    try:
        return DIVERGENCES[name]
    except KeyError:
        raise ValueError(f"unknown distillation loss {name!r}; accepted: {sorted(DIVERGENCES)}") from None


def token_divergence(student_logits: jax.Array, teacher_logits: jax.Array, *, kind: str = "forward_kl",
                     beta: float = 0.5, temperature: float = 1.0) -> jax.Array:
    """T^2 * D(softmax(teacher / T), softmax(student / T)) per position: logits [..., V] -> [...]."""
    t = float(temperature)
    if t <= 0:
        raise ValueError(f"distillation temperature must be > 0, found {t}")
    s_lp = jax.nn.log_softmax(_f32(student_logits) / t, axis=-1)
    t_lp = jax.nn.log_softmax(jax.lax.stop_gradient(_f32(teacher_logits)) / t, axis=-1)
    return (t * t) * divergence(kind)(s_lp, t_lp, beta)


def _log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for log-probabilities x <= 0, floored at log(1e-30) (a rest of mass ~0 stays finite)."""
    return jnp.log(jnp.maximum(-jnp.expm1(jnp.minimum(x, 0.0)), 1e-30))


def topk_token_divergence(student_logits: jax.Array, teacher_logp: jax.Array, teacher_ids: jax.Array, *,
                          kind: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                          tail: bool = False) -> jax.Array:
    """T^2 * D on the teacher's top-k support (module docstring): student logits [..., V]; the teacher's
    temperature-T log-probs of its k most likely tokens and their ids [..., k] (`teacher_topk`) -> [...].
    tail=False: both renormalised over the k tokens; tail=True: k + 1 outcomes (the k tokens and the rest)."""
    t = float(temperature)
    if t <= 0:
        raise ValueError(f"distillation temperature must be > 0, found {t}")
    s_lp = jax.nn.log_softmax(_f32(student_logits) / t, axis=-1)
    s_k = jnp.take_along_axis(s_lp, teacher_ids.astype(jnp.int32), axis=-1)
    t_k = jax.lax.stop_gradient(_f32(teacher_logp))
    if tail:
        rest = lambda lp: _log1mexp(jax.nn.logsumexp(lp, axis=-1, keepdims=True))  # noqa: E731
        s_k, t_k = jnp.concatenate([s_k, rest(s_k)], -1), jnp.concatenate([t_k, rest(t_k)], -1)
    else:
        s_k, t_k = jax.nn.log_softmax(s_k, axis=-1), jax.nn.log_softmax(t_k, axis=-1)
    return (t * t) * divergence(kind)(s_k, t_k, beta)


def teacher_topk(teacher_logits: jax.Array, k: int, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """(log-probs at temperature T, ids) of the teacher's k most likely tokens: [..., V] -> [..., k] twice."""
    return jax.lax.top_k(jax.nn.log_softmax(_f32(teacher_logits) / float(temperature), axis=-1), k)


def distill_token_loss(student_logits: jax.Array, targets: jax.Array, teacher: dict[str, jax.Array], *,
                       kind: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                       alpha: float = 1.0, tail: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token (loss, divergence, cross-entropy), [...] each, of student logits [..., V] and the data's next
    tokens [...], against the teacher given as full `{"logits": [..., V]}` or top-k `{"logp", "ids": [..., k]}`
    (`teacher_topk` at the same temperature): loss = alpha * T^2 D + (1 - alpha) * CE (module docstring)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"distillation alpha must be in [0, 1], found {alpha}")
    kw = dict(kind=kind, beta=beta, temperature=temperature)
    if "logits" in teacher:
        d = token_divergence(student_logits, teacher["logits"], **kw)
    else:
        d = topk_token_divergence(student_logits, teacher["logp"], teacher["ids"], tail=tail, **kw)
    lp = jax.nn.log_softmax(_f32(student_logits), axis=-1)
    ce = -jnp.take_along_axis(lp, targets.astype(jnp.int32)[..., None], axis=-1)[..., 0]
    return alpha * d + (1.0 - alpha) * ce, d, ce


def make_token_loss(kind: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0, alpha: float = 1.0,
                    tail: bool = False):
    """`distill_token_loss` with fixed settings (checked here, at configuration time)."""
    divergence(kind)
    if temperature <= 0 or not 0.0 <= alpha <= 1.0 or not 0.0 <= beta <= 1.0:
        raise ValueError(f"distillation settings out of range: temperature={temperature} (> 0), alpha={alpha} "
                         f"and beta={beta} (in [0, 1])")
    return functools.partial(distill_token_loss, kind=kind, beta=beta, temperature=temperature, alpha=alpha,
                             tail=bool(tail))
