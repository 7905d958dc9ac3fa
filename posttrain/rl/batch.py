"""The RL training batch (`RLBatch`, a typed pytree) and the one function that builds it from scored rollouts.

Layout: the teacher-forced layout of `posttrain.rollout.layout` (the one `Policy.score` uses too): prompts
left-padded into the first P columns and completions right-padded into the last C columns, so every completion
starts at column P. The loss then projects onto the vocabulary only at the C completion positions (the prompt's
logits are never computed). Entry j of the per-token arrays [N, C] (`loss_mask`, the log-probs) is about
completion token j, predicted from column P-1+j. P and C are rounded up to multiples of `multiple` so the jitted
step compiles once per (P, C) bucket.

`RLBatch` is registered with `jax.tree_util.register_dataclass` (a plain frozen dataclass whose array
fields are pytree leaves): the trainer moves, splits and jits it like a dict of arrays, the loss reads it
by attribute, and `dataclasses.replace` gives a changed copy. JAX's own registration rather than
`flax.struct.dataclass`: the batch is host-side numpy data built below the model layer and needs nothing
from Flax. An optional field is None when absent (a None leaf is an empty subtree): which fields are None
is fixed for a run, so the jitted step sees one structure (the learner always fills `old_logp`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from posttrain.algorithms import dapo
from posttrain.rollout.layout import bucket_length, stack_images, teacher_forced
from posttrain.rollout.prompts import PromptSet
from posttrain.rollout.rollouts import Rollouts

__all__ = ["GroupAdvantages", "RLBatch", "bucket_length", "build_rl_batch", "completion_logprobs", "place_experts",
           "stack_images"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RLBatch:
    """One RL step's training arrays (N rows; T = P + C columns; see the module docstring).

    input_ids, attention_mask, positions [N, T]: the model's inputs (prompt left-padded, completion after).
    segment_ids [N, T] | None: packed rows' sequence ids (None: one sequence per row).
    loss_mask [N, C] float: weight of completion token j in the loss (0 on padding and on filtered sequences;
      a multi-turn buffer puts 0 on the tokens the model did not sample).
    advantages [N] (one per sequence) or [N, C] (per token, e.g. on-policy distillation).
    behaviour_logp [N, C]: the sampler's log-probs of the sampled tokens (the behaviour policy mu).
    old_logp [N, C] | None: the proximal policy's (pi_old); None until the learner sets it (the behaviour
      log-probs while the policy has not moved, else recomputed by the training forward).
    ref_logp [N, C] | None: the reference policy's (KL penalty, beta > 0).
    is_weight [N, C] | None: the rollout correction's per-token weights (`posttrain.algorithms.correction`: pi_old /
      pi_sampler truncated or masked; 0 = the token leaves the loss); None without a correction. The learner sets
      it once per batch, after the proximal log-probs.
    pixel_values [N, M, 3, H, W] | None: a vision-language batch's images, row r's in prompt order, blank
      (zero) images after them (`posttrain.algorithms.sft.images_in_order` orders them for the model); None
      for text (the same compiled programs as before).
    image_counts [N] int32 | None: how many of row r's `pixel_values` are its own (the rest are blanks); what
      packing (`posttrain.rl.packing`) needs to lay a packed row's images out; None for text.
    routed_experts [N, T, L_sparse, k] int8/int16 | None: routing replay (a mixture of experts): the experts the
      sampler routed the token in each column to, aligned with input_ids; -1 where nothing was recorded (padding,
      and each sequence's last token, which the sampler never fed). The policy's passes route to them
      (`posttrain.rl.loss`); None without replay.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    positions: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    behaviour_logp: np.ndarray
    old_logp: np.ndarray | None = None
    ref_logp: np.ndarray | None = None
    is_weight: np.ndarray | None = None
    segment_ids: np.ndarray | None = None
    pixel_values: np.ndarray | None = None
    image_counts: np.ndarray | None = None
    routed_experts: np.ndarray | None = None

    def __len__(self) -> int:
        return int(np.shape(self.input_ids)[0])

    @property
    def completion_len(self) -> int:
        """C: the completion columns (the last C of each row), where the vocabulary is projected."""
        return int(np.shape(self.loss_mask)[1])

    @property
    def proximal_logp(self):
        """pi_old's log-probs: `old_logp`, or the behaviour log-probs while it is not set."""
        return self.behaviour_logp if self.old_logp is None else self.old_logp

    def model_inputs(self, replay: bool = False) -> dict[str, np.ndarray]:
        """The arrays a forward pass reads (`Trainer.token_logprobs`, `FrozenScorer`), by their model names;
        with `replay` also the recorded experts as `replay` when the batch has them (the policy's passes)."""
        out = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "positions": self.positions}
        if self.segment_ids is not None:
            out["segment_ids"] = self.segment_ids
        if self.pixel_values is not None:
            out["pixel_values"] = self.pixel_values
        if replay and self.routed_experts is not None:
            out["replay"] = self.routed_experts
        return out

    def replace(self, **changes) -> "RLBatch":
        return dataclasses.replace(self, **changes)

    def rows(self, index) -> "RLBatch":
        """The batch of rows `index` (a minibatch)."""
        return jax.tree.map(lambda v: v[index], self)


def build_rl_batch(rollouts: Rollouts, advantages: np.ndarray, *, seq_weights: np.ndarray | None = None,
                   pad_id: int = 0, multiple: int = 16, images=None, at_least: tuple[int, int] = (0, 0)) -> RLBatch:
    """The `RLBatch` of scored rollouts: model inputs [N, P+C]; per-token [N, C]; `advantages` [N] or [N, C].

    `seq_weights` [N] scale each sequence's loss mask (0 drops it, e.g. DAPO overlong filtering). Multi-turn
    rollouts (`rollouts.completion_mask`) have loss mask 1 on sampled tokens only; the trajectory's advantage
    is then spread over them (a per-sequence advantage applies to every token with mask 1).
    `images` (image prompts): row i's prompt images, pixel arrays [3, H, W] (`stack_images`).
    Rollouts with recorded experts (`rollouts.routed_experts`, routing replay) fill `routed_experts`.
    `at_least`: lower bounds of (P, C), the prompt and completion columns (a run's bounds: `RLShapes`, so every
    step's batch has one shape).
    """
    n = len(rollouts)
    layout = teacher_forced(rollouts.prompt_ids, rollouts.completion_ids, pad_id=pad_id, multiple=multiple,
                            at_least=at_least)
    p, c = layout.input_ids.shape[1] - layout.completion_len, layout.completion_len
    loss_mask = np.zeros((n, c), np.float32)
    behaviour_logp = np.zeros((n, c), np.float32)
    masks = rollouts.completion_mask or [None] * n  # multi-turn: 0 on appended tokens (tool results, headers)
    for i, (comp, lp) in enumerate(zip(rollouts.completion_ids, rollouts.logprobs)):
        loss_mask[i, : len(comp)] = 1.0 if masks[i] is None else masks[i]
        behaviour_logp[i, : len(comp)] = lp
    if seq_weights is not None:
        loss_mask *= np.asarray(seq_weights, np.float32)[:, None]
    return RLBatch(input_ids=layout.input_ids, attention_mask=layout.attention_mask, positions=layout.positions,
                   loss_mask=loss_mask, advantages=np.asarray(advantages, np.float32), behaviour_logp=behaviour_logp,
                   pixel_values=None if images is None else stack_images(images),
                   image_counts=None if images is None else np.asarray([len(r) for r in images], np.int32),
                   routed_experts=place_experts(rollouts, p, p + c) if rollouts.routed_experts else None)


def place_experts(rollouts: Rollouts, p: int, t: int) -> np.ndarray:
    """The rollouts' recorded experts [N, t, L_sparse, k] in the batch layout: sample i's row j (the token at
    position j of prompt + completion) at column p - len(prompt) + j; -1 elsewhere (module docstring)."""
    first = np.asarray(rollouts.routed_experts[0])
    dtype = np.result_type(*(np.asarray(x).dtype for x in rollouts.routed_experts))
    out = np.full((len(rollouts), t, *first.shape[1:]), -1, dtype)
    for i, (prompt, experts) in enumerate(zip(rollouts.prompt_ids, rollouts.routed_experts)):
        start = p - len(prompt)
        out[i, start: start + len(experts)] = experts
    return out


def completion_logprobs(full: np.ndarray, batch: RLBatch) -> np.ndarray:
    """Slices [N, P+C-1] per-token log-probs (`Trainer.token_logprobs`) to the completion columns [N, C]."""
    return np.asarray(full)[:, -batch.completion_len:]


@dataclasses.dataclass(frozen=True)
class GroupAdvantages:
    """The GRPO family's batch builder: a step's rollouts -> (the training batch, extra metrics: none). Group
    advantages (the preset's estimator), loss masks (DAPO's overlong filtering), the prompts' images, and the
    sampler's log-probs as behaviour log-probs (the learner adds the proximal and reference ones)."""

    advantage: Callable[..., Any]
    overlong_filtering: bool
    prompts: PromptSet
    pad_id: int
    columns: tuple[int, int] = (0, 0)  # (P, C) at least: `posttrain.rl.prompts.batch_columns`

    def __call__(self, ro: Rollouts) -> tuple[RLBatch, dict[str, float]]:
        adv = np.asarray(self.advantage(ro.rewards, ro.group_size))
        weights = dapo.overlong_mask(ro.finish_reasons) if self.overlong_filtering else None
        images = [p.images for p in self.prompts.select(ro.record_index)] if self.prompts.has_images else None
        return build_rl_batch(ro, adv, seq_weights=weights, pad_id=self.pad_id, images=images,
                              at_least=self.columns), {}
