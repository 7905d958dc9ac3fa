"""A multi-turn trajectory sampled through an OpenAI-compatible endpoint (a verifiers environment talking to our
in-process server), stitched back into one training sequence of exactly the ids the sampler produced.

Each turn's answer carries the ids of its prompt as the server rendered and tokenized the conversation so far
(`prompt_token_ids`), the ids it sampled (`token_ids`) and their log-probs. The first turn's prompt is the
trajectory's prompt. A later turn's prompt must begin with everything before it, the previous turn's prompt and
its sampled ids, exactly: the rest of it is what the environment appended (tool results, the next user turn, the
template's headers), trained with mask 0. When it does not (the server's chat template rendered the model's own
turn into other ids than it sampled: a re-tokenized conversation), the model did not see the sequence we would
train on, so that turn and every turn after it are refused: counted, said why, and not trained on (token-in/
token-out). What is kept:

    prompt = turn 1's prompt ids
    completion = sampled_1 | appended_1 | sampled_2 | ... | sampled_k     (k = the turns kept)
    mask       = 1...1     | 0...0      | 1...1     | ... | 1...1
    logprobs   = the server's for sampled ids, 0.0 for appended ones
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Stitched", "TurnTokens", "stitch"]


@dataclasses.dataclass(frozen=True)
class TurnTokens:
    """One turn's ids as the server gave them: its prompt, its sampled ids and their log-probs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]


@dataclasses.dataclass(frozen=True)
class Stitched:
    """A trajectory as one training sequence (module docstring): `turns` kept, `refused` turns after them and why
    the first of them was (`reason`; None when every turn was kept)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    turns: int
    refused: int = 0
    reason: str | None = None


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def stitch(turns: Sequence[TurnTokens]) -> Stitched:
    """The training sequence of a trajectory's `turns` (at least one; see the module docstring)."""
    if not turns:
        raise ValueError("a trajectory needs at least one turn")
    first = turns[0]
    if len(first.logprobs) != len(first.completion_ids):
        raise ValueError(f"turn 1: {len(first.logprobs)} log-probs for {len(first.completion_ids)} sampled ids")
    seen = list(first.prompt_ids) + list(first.completion_ids)  # what the model has seen and sampled so far
    completion, mask, lps = list(first.completion_ids), [1] * len(first.completion_ids), list(first.logprobs)
    for k, turn in enumerate(turns[1:], start=2):
        reason = None
        if len(turn.prompt_ids) < len(seen) or list(turn.prompt_ids[:len(seen)]) != seen:
            at = _first_difference(turn.prompt_ids, seen)
            reason = (f"turn {k}: its prompt ids differ from the ids sampled before it at position {at} of {len(seen)} "
                      "(the conversation was re-tokenized)")
        elif len(turn.logprobs) != len(turn.completion_ids):
            reason = f"turn {k}: {len(turn.logprobs)} log-probs for {len(turn.completion_ids)} sampled ids"
        if reason is not None:
            return Stitched(list(first.prompt_ids), completion, mask, lps, k - 1, len(turns) - k + 1, reason)
        appended = list(turn.prompt_ids[len(seen):])
        completion += appended + list(turn.completion_ids)
        mask += [0] * len(appended) + [1] * len(turn.completion_ids)
        lps += [0.0] * len(appended) + list(turn.logprobs)
        seen = list(turn.prompt_ids) + list(turn.completion_ids)
    return Stitched(list(first.prompt_ids), completion, mask, lps, len(turns))
