"""The learner: a prepared RL batch -> proximal and reference log-probs -> `ppo_epochs` x `minibatches` updates.

Old (proximal) log-probs: recomputed with the training forward before the updates whenever a rollout correction is
on (`posttrain.algorithms.correction`: importance weights pi_old / pi_sampler, masking, rejection), or always with
`old_logprobs=recompute`; otherwise the sampler's own (behaviour) log-probs stand in for them (the PPO ratio is then
taken against the sampler). After recomputing, the learner computes the rollout correction of the whole batch once
(one compiled program): the per-token weights go into the batch (`RLBatch.is_weight`, 0 = out of the loss), its
metrics (`mismatch_kl`, `is/*`) into the step's. Reference log-probs (beta > 0) come from a `FrozenScorer`: the LoRA
base with adapters off, or a frozen copy of the initial weights held without optimizer state.

With `pack` (`learner.pack`) the learner packs each minibatch's sequences into rows (`posttrain.rl.packing`)
before its update, and scores old/reference log-probs on the whole batch packed the same way: the loss
and the log-probs equal the padded batch's, the forward computes only the rows that hold tokens. Minibatches
still split the batch by sequences, as without packing. With `learner.share_prompts` (the RL default for text
prompts) a row may hold one prompt and several of its completions (the prompt computed once a row), whenever
that layout computes less.

Routing replay (a mixture of experts; a batch with `routed_experts`, `learner.routing_replay`): the policy's
log-prob recomputation routes every token to the sampler's recorded experts, as the update does
(`posttrain.rl.loss`); the reference (beta > 0) does not replay: it scores with its own router.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import numpy as np
from flax import nnx

from posttrain import distributed
from posttrain.algorithms.correction import RolloutCorrection, rollout_correction
from posttrain.algorithms.registry import GRPOFamily, loss_kwargs
from posttrain.algorithms.sft import token_logprobs
from posttrain.config import ConfigError
from posttrain.models.moe_loss import RouterLoss
from posttrain.rl.batch import RLBatch
from posttrain.rl.config import LearnerConfig
from posttrain.rl.loss import make_rl_loss, packed_logprobs, routed_experts
from posttrain.rl.packing import PackedRLBatch, PackPlan, attention_span
from posttrain.rollout.prompts import PromptSet
from posttrain.training.config import MoELossConfig, TrainerConfig
from posttrain.training.run import Run

__all__ = ["FrozenScorer", "Learner", "TrainerScorer", "build_learner", "check_routing_replay", "policy_loss_kwargs"]


def _packed_fn(graphdef, chunk_size, replay: bool = False):
    """jit of (states, packed batch) -> its slots' log-probs [R*S, C] under nnx.merge(graphdef, *states); with
    `replay`, routed to the batch's recorded experts when it has them."""
    def packed_lp(states, pb):
        return packed_logprobs(nnx.merge(graphdef, *states), pb, chunk_size,
                               replay=routed_experts(pb) if replay else None)[0]

    return jax.jit(packed_lp)


def _replayed_fn(graphdef, chunk_size):
    """jit of (states, model inputs with `replay`, last) -> per-token log-probs (`token_logprobs`) routed to the
    recorded experts `replay` [B, T, L_sparse, k] (what `Trainer.token_logprobs` computes, replayed)."""
    def replayed_lp(states, inputs, last):
        return token_logprobs(nnx.merge(graphdef, *states), inputs["input_ids"],
                              attention_mask=inputs["attention_mask"], positions=inputs["positions"],
                              segment_ids=inputs.get("segment_ids"), chunk_size=chunk_size, last=last,
                              pixel_values=inputs.get("pixel_values"), replay=inputs["replay"])

    return jax.jit(replayed_lp, static_argnums=2)


class FrozenScorer:
    """Per-token log-probs of a frozen model (no gradients, no optimizer state), on the trainer's mesh: [B, T-1],
    or [B, C] for the last C tokens with `last=C` (the vocabulary projected there only)."""

    def __init__(self, model, trainer, chunk_size: int | None = None):
        if trainer.mesh is not None:
            distributed.shard_model(model, trainer.mesh)
        graphdef, self.state = nnx.split(model)
        self.put_batch = trainer.put_batch

        def frozen_lp(state, input_ids, attention_mask, positions, last, pixel_values):
            return token_logprobs(nnx.merge(graphdef, state), input_ids, attention_mask=attention_mask,
                                  positions=positions, chunk_size=chunk_size, last=last, pixel_values=pixel_values)

        self._fn = jax.jit(frozen_lp, static_argnums=4)
        self._packed = _packed_fn(graphdef, chunk_size)

    def __call__(self, inputs: dict[str, np.ndarray], last: int | None = None) -> np.ndarray:
        """Scores `inputs` (`RLBatch.model_inputs()`: input_ids, attention_mask, positions[, pixel_values]; a
        `replay` entry is ignored: a frozen model routes with its own router)."""
        dev = self.put_batch({k: inputs[k] for k in ("input_ids", "attention_mask", "positions", "pixel_values")
                              if k in inputs})
        return distributed.to_host(self._fn(self.state, dev["input_ids"], dev["attention_mask"], dev["positions"],
                                            last, dev.get("pixel_values")))

    def packed(self, batch: PackedRLBatch) -> np.ndarray:
        """The log-probs [R*S, C] of a packed batch's slots (`posttrain.rl.loss.packed_logprobs`)."""
        return distributed.to_host(self._packed((self.state,), self.put_batch(batch)))


class TrainerScorer:
    """Per-token log-probs under the trainer's current weights (`adapters=False`: a LoRA model's base, RL's
    reference without a second copy of the weights), padded (`(inputs, last=C)`) or packed (`packed`). The policy
    (`adapters=True`) routes to recorded experts when given them (inputs' `replay`, a packed batch's
    `routed_experts`: routing replay); the base never does (it is the reference)."""

    def __init__(self, trainer, *, adapters: bool = True):
        self.trainer, self.adapters = trainer, adapters
        self._packed = None  # compiled on the first packed call
        self._replayed = None  # ... and on the first padded call with recorded experts

    def __call__(self, inputs: dict[str, np.ndarray], last: int | None = None) -> np.ndarray:
        t = self.trainer
        if "replay" in inputs:
            if self.adapters:
                if self._replayed is None:
                    self._replayed = _replayed_fn(t.graphdef, t.logprob_chunk_size)
                return distributed.to_host(self._replayed((t.params, t.rest), t.put_batch(inputs), last))
            inputs = {k: v for k, v in inputs.items() if k != "replay"}
        kw = {} if self.adapters else {"adapters": False}
        return distributed.to_host(t.token_logprobs(inputs, last=last, **kw))

    def packed(self, batch: PackedRLBatch) -> np.ndarray:
        t = self.trainer
        if self._packed is None:
            self._packed = _packed_fn(t.graphdef if self.adapters else t.graphdef_base, t.logprob_chunk_size,
                                      replay=self.adapters)
        return distributed.to_host(self._packed((t.params, t.rest), t.put_batch(batch)))


class Learner:
    """Applies one RL step's updates to a `Trainer` (see the module docstring)."""

    def __init__(self, trainer, loss_fn, *, ppo_epochs: int, minibatches: int, seed: int, recompute_old: bool,
                 correction: RolloutCorrection | None = None, ref_fn: Callable[..., np.ndarray] | None = None,
                 pack: bool = False, attn_span: float | None = None, prompt_min: int | None = None):
        """`ref_fn(model_inputs, last=C)`: the reference's log-probs (None: no KL term; with `pack`, a scorer with
        a `packed(batch)` method: `FrozenScorer`, `TrainerScorer`); `correction`: the rollout correction (None:
        off), with which pi_old is always recomputed; `pack`: train and score packed batches
        (`posttrain.rl.packing`); `attn_span` (with `pack`): rows may also share a prompt, the cheaper layout chosen
        per batch by `posttrain.rl.packing.pack_cheapest` with this attention span;
        `prompt_min` (with `pack`): the run's shortest prompt, with which the packed sizes are fixed at the first
        batch, so the update and the scoring compile once (`posttrain.rl.packing.PackPlan`)."""
        self.trainer, self.loss_fn = trainer, loss_fn
        self.ppo_epochs, self.minibatches, self.seed = ppo_epochs, minibatches, seed
        self.correction = correction if correction is not None and correction.active else None
        self.recompute_old = recompute_old or self.correction is not None
        self.ref_fn = ref_fn
        # the correction's weights and metrics over a whole batch: one program (metrics alone without a correction)
        self._correct = jax.jit(functools.partial(rollout_correction,
                                                  corr=(self.correction or RolloutCorrection(is_level="none"))))
        self.pack = pack
        self.policy = TrainerScorer(trainer)
        self._cells: dict[str, int] = {}  # this update's token counts (packing only)
        self._plan_args = dict(attn_span=attn_span, prompt_min=prompt_min)
        self._plans: dict[str, PackPlan] = {}  # per use (train, score), made at its first batch: `_pack`

    def _pack(self, batch: RLBatch, use: str):
        """`batch` packed by the plan of `use`: a row count that the trainer's micro-batches and data shards divide,
        sizes fixed (or grown) per use, so each compiled program sees one shape."""
        if use not in self._plans:
            ways, mesh = 1, self.trainer.mesh
            if mesh is not None:
                ways = int(mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1))
            whole = use == "score" or self.minibatches == 1  # minibatches split groups at random
            self._plans[use] = PackPlan(row_multiple=math.lcm(self.trainer.grad_accum, ways), whole_groups=whole,
                                        **self._plan_args)
        return self._plans[use].pack(batch)

    def _train_batch(self, batch: RLBatch):
        """What the trainer steps on: `batch`, or it packed (its token counts added up for the metrics)."""
        if not self.pack:
            return batch
        packed, layout = self._pack(batch, "train")
        for k in ("tokens", "packed_cells", "padded_cells"):
            self._cells[f"pack/{k}"] = self._cells.get(f"pack/{k}", 0) + getattr(layout, k)
        return packed

    def update(self, batch: RLBatch, step: int) -> dict[str, float]:
        """Updates the policy on `batch` (built by `posttrain.rl.batch.build_rl_batch`); returns mean metrics."""
        n, mb, accum = len(batch), self.minibatches, self.trainer.grad_accum
        if n % mb or (n // mb) % accum:
            raise ValueError(f"{n} rollouts do not split into learner.minibatches={mb} x trainer.grad_accum={accum}")
        batch, corrected = self.correct(self.score(batch))
        rng = np.random.default_rng([self.seed, step])
        metrics: list[dict[str, float]] = []
        self._cells = {}
        for _ in range(self.ppo_epochs):
            order = rng.permutation(n) if mb > 1 else np.arange(n)
            for part in np.split(order, mb):
                metrics.append(self.trainer.step(self._train_batch(batch.rows(part)), self.loss_fn))
        out = {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}
        # packing: real tokens, and the cells the forward passes computed packed / would have computed padded
        return {**out, **corrected, **{k: float(v) for k, v in self._cells.items()}}

    def correct(self, batch: RLBatch) -> tuple[RLBatch, dict[str, float]]:
        """`batch` (its proximal log-probs set) with the rollout correction's weights when one is on, and the
        correction's metrics whenever the proximal log-probs were recomputed (`rollout_correction`)."""
        if not self.recompute_old:
            return batch, {}
        weights, metrics = distributed.to_host(self._correct(batch.old_logp, batch.behaviour_logp, batch.loss_mask))
        if self.correction is not None:
            batch = batch.replace(is_weight=np.asarray(weights, np.float32))
        return batch, {k: float(v) for k, v in metrics.items()}

    def score(self, batch: RLBatch) -> RLBatch:
        """`batch` with its proximal log-probs set (the behaviour ones, or recomputed: see the module docstring)
        and the reference's when there is one. Both are scored at the completion (loss) tokens only."""
        if not self.recompute_old and self.ref_fn is None:
            return batch.replace(old_logp=batch.behaviour_logp)
        if self.pack:
            packed, layout = self._pack(batch, "score")
            run = lambda scorer: layout.unpack(scorer.packed(packed))  # noqa: E731
        else:
            c = batch.completion_len  # the vocabulary is projected at the completion columns only
            # the policy replays recorded experts (routing replay); the reference ignores them
            run = lambda scorer: distributed.to_host(scorer(batch.model_inputs(replay=True), last=c))  # noqa: E731
        old = run(self.policy) if self.recompute_old else batch.behaviour_logp
        ref = run(self.ref_fn) if self.ref_fn is not None else None
        return batch.replace(old_logp=old, ref_logp=ref)


# ---------------------------------------------------------------------- built from the config's sections
def policy_loss_kwargs(preset: GRPOFamily, max_new_tokens: int) -> dict:
    """The policy loss's keyword arguments: the algorithm preset's and the length normaliser (default: the
    generation budget). The learner's rollout correction travels with each batch (`RLBatch.is_weight`)."""
    kw = loss_kwargs(preset)
    kw["max_tokens"] = max_new_tokens if preset.max_tokens is None else preset.max_tokens
    kw["beta"] = float(preset.beta)
    if kw["beta"] == 0.0:
        kw.pop("kl_estimator")
    return kw


def check_routing_replay(learner: LearnerConfig, model_cfg) -> None:
    """`learner.routing_replay` needs a mixture of experts (a one-line config error on a dense model). With it on,
    the sources record the experts the sampler routed to (`record_experts`), the batch carries them
    (`RLBatch.routed_experts`) and the learner's policy passes replay them (`posttrain.rl.learner`)."""
    if learner.routing_replay and not model_cfg.is_moe:
        raise ConfigError(f"learner.routing_replay: needs a mixture-of-experts model; this {model_cfg.model_type} "
                          "model has no experts (set learner.routing_replay=false)")


def build_learner(lc: LearnerConfig, preset: GRPOFamily, run: Run, tc: TrainerConfig, moe: MoELossConfig, *,
                  completion_budget: int, image_prompts: bool, prompts: PromptSet) -> Learner:
    """The learner of `run.trainer`: the policy loss (the length normaliser defaults to `completion_budget`), its
    epochs and minibatches, and the reference scorer when beta > 0 (which routes with its own router: a batch's
    recorded experts, `learner.routing_replay`, are the policy's only); packed rows sized once by the shortest of
    the train `prompts`."""
    trainer = run.trainer
    kw = policy_loss_kwargs(preset, completion_budget)
    share = lc.share_prompts if lc.share_prompts is not None else not image_prompts
    chunk = tc.loss_chunk_size or None
    ref_fn = None
    if kw["beta"] > 0:
        if trainer.has_lora:  # the base model with adapters off: no second copy of the weights
            ref_fn = TrainerScorer(trainer, adapters=False)
        else:
            ref_fn = FrozenScorer(run.frozen_model(), trainer, chunk)
    router = RouterLoss(**dataclasses.asdict(moe))  # a mixture of experts' router terms (none when dense)
    return Learner(trainer, make_rl_loss(kw, chunk_size=chunk, router=router), ppo_epochs=lc.ppo_epochs,
                   minibatches=lc.minibatches, seed=tc.seed, recompute_old=lc.old_logprobs == "recompute",
                   correction=lc.settings(), ref_fn=ref_fn, pack=lc.pack or share,
                   attn_span=attention_span(trainer.model().cfg) if share else None,
                   prompt_min=min((len(x) for x in prompts.ids), default=1))
