"""The learner: a prepared RL batch -> proximal and reference log-probs -> `ppo_epochs` x `minibatches` updates.

Old (proximal) log-probs: the sampler's own (behaviour) log-probs stand in for them while the policy has
not moved since sampling; they are recomputed with the training forward when it has (a stale group from
the fleet) and the off-policy correction is on, or always with `old_logprobs=recompute`. Reference
log-probs (beta > 0) come from a `FrozenScorer`: the LoRA base with adapters off, or a frozen copy of
the initial weights held without optimizer state.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from flax import nnx

from posttrain import distributed
from posttrain.algorithms.sft import token_logprobs
from posttrain.rl.batch import RLBatch

__all__ = ["Learner", "FrozenScorer"]


class FrozenScorer:
    """Per-token log-probs of a frozen model (no gradients, no optimizer state), on the trainer's mesh: [B, T-1],
    or [B, C] for the last C tokens with `last=C` (the vocabulary projected there only)."""

    def __init__(self, model, trainer, chunk_size: int | None = None):
        if trainer.mesh is not None:
            distributed.shard_model(model, trainer.mesh)
        graphdef, self.state = nnx.split(model)
        self.put_batch = trainer.put_batch

        def lp(state, input_ids, attention_mask, positions, last):
            return token_logprobs(nnx.merge(graphdef, state), input_ids, attention_mask=attention_mask,
                                  positions=positions, chunk_size=chunk_size, last=last)

        self._fn = jax.jit(lp, static_argnums=4)

    def __call__(self, inputs: dict[str, np.ndarray], last: int | None = None) -> np.ndarray:
        """Scores `inputs` (`RLBatch.model_inputs()`: input_ids, attention_mask, positions)."""
        dev = self.put_batch({k: inputs[k] for k in ("input_ids", "attention_mask", "positions")})
        return distributed.to_host(self._fn(self.state, dev["input_ids"], dev["attention_mask"], dev["positions"], last))


class Learner:
    """Applies one RL step's updates to a `Trainer` (see the module docstring)."""

    def __init__(self, trainer, loss_fn, *, ppo_epochs: int, minibatches: int, seed: int, recompute_old: bool,
                 correct_off_policy: bool, ref_fn: Callable[..., np.ndarray] | None = None):
        """`ref_fn(model_inputs, last=C)`: the reference's log-probs (None: no KL term); `correct_off_policy`:
        the loss weights by pi_old / mu (`ISLevel.corrects`), so pi_old is recomputed once the policy moved."""
        self.trainer, self.loss_fn = trainer, loss_fn
        self.ppo_epochs, self.minibatches, self.seed = ppo_epochs, minibatches, seed
        self.recompute_old, self.correct_off_policy, self.ref_fn = recompute_old, correct_off_policy, ref_fn

    def update(self, batch: RLBatch, step: int, *, policy_moved: bool) -> dict[str, float]:
        """Updates the policy on `batch` (built by `posttrain.rl.batch.build_rl_batch`); returns mean metrics."""
        n, mb, accum = len(batch), self.minibatches, self.trainer.grad_accum
        if n % mb or (n // mb) % accum:
            raise ValueError(f"{n} rollouts do not split into learner.minibatches={mb} x trainer.grad_accum={accum}")
        batch = self.score(batch, policy_moved=policy_moved)
        rng = np.random.default_rng([self.seed, step])
        metrics: list[dict[str, float]] = []
        for _ in range(self.ppo_epochs):
            order = rng.permutation(n) if mb > 1 else np.arange(n)
            for part in np.split(order, mb):
                metrics.append(self.trainer.step(batch.rows(part), self.loss_fn))
        return {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}

    def score(self, batch: RLBatch, *, policy_moved: bool) -> RLBatch:
        """`batch` with its proximal log-probs set (the behaviour ones, or recomputed: see the module docstring)
        and the reference's when there is one. Both are scored at the completion columns only."""
        c = batch.completion_len  # the vocabulary is projected at the completion columns only
        old = batch.behaviour_logp
        if self.recompute_old or (policy_moved and self.correct_off_policy):
            old = distributed.to_host(self.trainer.token_logprobs(batch.model_inputs(), last=c))
        ref = distributed.to_host(self.ref_fn(batch.model_inputs(), last=c)) if self.ref_fn is not None else None
        return batch.replace(old_logp=old, ref_logp=ref)
