"""Stitching a trajectory sampled through an OpenAI-compatible endpoint back into the exact sampled ids: appended
ids between turns get mask 0, a turn whose prompt re-tokenized what was sampled before it is refused with every
turn after it (counted, with the reason)."""

import pytest

from posttrain.rollout.stitching import TurnTokens, stitch


def test_one_turn_is_its_prompt_and_sampled_ids():
    s = stitch([TurnTokens([1, 2, 3], [7, 8], [-0.5, -0.25])])
    assert (s.prompt_ids, s.completion_ids, s.mask, s.logprobs) == ([1, 2, 3], [7, 8], [1, 1], [-0.5, -0.25])
    assert (s.turns, s.refused, s.reason) == (1, 0, None)


def test_turns_are_joined_by_the_appended_ids():
    t1 = TurnTokens([1, 2], [5, 6], [-1.0, -2.0])
    t2 = TurnTokens([1, 2, 5, 6, 9, 9], [7], [-3.0])  # 9 9: the tool result the environment appended
    t3 = TurnTokens([1, 2, 5, 6, 9, 9, 7, 4], [8, 2], [-4.0, -5.0])
    s = stitch([t1, t2, t3])
    assert s.prompt_ids == [1, 2]
    assert s.completion_ids == [5, 6, 9, 9, 7, 4, 8, 2]
    assert s.mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert s.logprobs == [-1.0, -2.0, 0.0, 0.0, -3.0, 0.0, -4.0, -5.0]
    assert (s.turns, s.refused) == (3, 0)


def test_a_re_tokenized_turn_is_refused_with_the_turns_after_it():
    t1 = TurnTokens([1, 2], [5, 6], [-1.0, -2.0])
    t2 = TurnTokens([1, 2, 56, 9], [7], [-3.0])  # the server rendered the sampled 5 6 as one id
    t3 = TurnTokens([1, 2, 56, 9, 7, 4], [8], [-4.0])
    s = stitch([t1, t2, t3])
    assert (s.completion_ids, s.mask, s.turns, s.refused) == ([5, 6], [1, 1], 1, 2)
    assert "turn 2" in s.reason and "position 2 of 4" in s.reason and "re-tokenized" in s.reason
    ok = TurnTokens([1, 2, 5, 6, 9], [7], [-3.0])
    shorter = TurnTokens([1, 2, 5], [8], [-4.0])  # a prompt shorter than what was sampled before it
    s = stitch([t1, ok, shorter])
    assert (s.completion_ids, s.mask, s.turns, s.refused) == ([5, 6, 9, 7], [1, 1, 0, 1], 2, 1)


def test_bad_turns_are_errors_or_refusals():
    with pytest.raises(ValueError, match="at least one turn"):
        stitch([])
    with pytest.raises(ValueError, match="turn 1: 1 log-probs for 2 sampled ids"):
        stitch([TurnTokens([1], [2, 3], [-1.0])])
    s = stitch([TurnTokens([1], [2], [-1.0]), TurnTokens([1, 2], [3, 4], [-1.0])])
    assert s.turns == 1 and s.refused == 1 and "1 log-probs for 2" in s.reason
