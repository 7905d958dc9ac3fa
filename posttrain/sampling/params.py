"""`SamplingParams` (what to sample, validated on construction) and `Completion` (one generated sequence)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample completions.

    temperature: 0 = greedy (argmax of the raw logits; top_k/top_p/min_p are then ignored).
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus, keep the smallest set of most
    likely tokens whose probability mass reaches top_p (1 = off). min_p: keep tokens whose probability
    is at least min_p times the most likely token's (0 = off). Filters apply in the order
    temperature, top-k, top-p, min-p.
    stop_token_ids: None = the model's end-of-sequence ids (the tokenizer's when the sampler has one);
    a list replaces them (`[]`: always generate max_new_tokens). A stop token is part of the completion.
    n: samples per prompt (a GRPO group); they share the prompt's prefill.
    seed: sample i of prompt p draws from a key derived from (seed, p, i) only, so results do not
    depend on slot count or scheduling; change it between calls for fresh samples.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    n: int = 1
    seed: int = 0

    def __post_init__(self):
        def bad(name, value, why):
            raise ValueError(f"SamplingParams.{name}={value!r}: {why}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad("max_new_tokens", self.max_new_tokens, "must be an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "must be >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "must be an integer >= 0 (0 = off)")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", self.top_p, "must be in (0, 1] (1 = off)")
        if not (0.0 <= self.min_p < 1.0):
            bad("min_p", self.min_p, "must be in [0, 1) (0 = off)")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, "must be an integer >= 1")
        if not isinstance(self.seed, int) or not (0 <= self.seed < 2**32):
            bad("seed", self.seed, "must be an integer in [0, 2**32)")
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if not all(isinstance(t, int) and t >= 0 for t in ids):
                bad("stop_token_ids", self.stop_token_ids, "must be a list of non-negative token ids")
            object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def modifies_distribution(self) -> bool:
        """True when the sampling distribution differs from softmax(raw logits)."""
        return not self.greedy and (
            self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
        )


@dataclasses.dataclass
class Completion:
    """One generated sequence (the prompt excluded).

    logprobs[i]: log-probability of token_ids[i] under the model's raw logits (float32 log-softmax,
    temperature 1), what RL importance ratios need. sampling_logprobs[i]: under the distribution it was
    actually drawn from (temperature and filters applied); None for greedy decoding or when that
    distribution is the raw one. finish_reason: "stop" (the last token is a stop token) or "length".

    Multi-turn sequences (`Sampler.generate(..., on_turn_end=...)`): token_ids holds every id after the
    prompt, the sampled ids of each turn and the ids appended after it, interleaved in sequence order;
    logprobs (and sampling_logprobs) are 0.0 at appended positions; mask[i] is 1 where token_ids[i] was
    sampled and 0 where it was appended; turns counts the turns sampled; finish_reason is the last turn's.
    Plain single-turn calls leave mask None and turns 1. versions[i]: the policy version of the weights that
    produced token_ids[i] (`Sampler.load_weights`; None for unversioned weights); it changes within a sequence
    only when `generate(between_segments=...)` swapped weights between decode segments.

    routed_experts (`generate(record_experts=True)` with a mixture of experts; else None): np.ndarray
    [len(prompt) + len(token_ids) - 1, L_sparse, k], int8 (int16 above 128 experts): row i holds, for sequence
    position i (the prompt's positions, then token_ids[:-1]; the last token is never fed to the model), the top-k
    experts (largest router probability first) each sparse layer's router chose when the sampler ran that
    position; what a learner replays (`model(..., replay=...)`).
    """

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float] | None
    finish_reason: Literal["stop", "length"]
    text: str | None = None
    mask: list[int] | None = None
    turns: int = 1
    versions: list[int | None] | None = None
    routed_experts: np.ndarray | None = None


@dataclasses.dataclass
class TurnEnd:
    """What `on_turn_end` is told when one turn of a multi-turn sequence ends (see `Sampler.generate`).

    prompt_index, sample_index: the sequence (as in `Completion`). turn: 0-based index of the turn that ended.
    token_ids, logprobs, sampling_logprobs: this turn's sampled ids and their log-probs (sampling_logprobs
    None unless the params modify the distribution). finish_reason: "stop" (a stop token ended the turn) or
    "length" (the turn's max_new_tokens, or the context limit). room: the most ids an append may hold now
    (the positions left before the context limit, less the one the next sampled token needs; 0 when nothing
    fits). length: tokens in the sequence so far, prompt included.
    """

    prompt_index: int
    sample_index: int
    turn: int
    token_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float] | None
    finish_reason: Literal["stop", "length"]
    room: int
    length: int
