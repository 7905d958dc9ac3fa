"""Reward record checks name the record a user would count (issue 26): lines of a file, and 1-based record
numbers for records that come from no file (a hub data set, a list in code)."""

from __future__ import annotations

import pytest

from posttrain.rewards.checks import RewardDataError, check_reward_records
from posttrain.rewards.runner import RewardRunner


def needs_answer(prompts, completions, answer, **fields):
    return [float(c == a) for c, a in zip(completions, answer)]


def test_records_without_a_file_are_numbered_from_one():
    runner = RewardRunner([needs_answer], num_workers=0)
    records = [{"prompt": "p", "answer": "1"}, {"prompt": "q", "answer": "2"}, {"prompt": "r"}]
    with pytest.raises(RewardDataError, match=r"^gsm8k:train, record 3: reward 'needs_answer' needs field\(s\) 'answer'"):
        check_reward_records(runner, records, source="gsm8k:train")
    with pytest.raises(RewardDataError, match=r"^<records>, record 1: "):
        check_reward_records(runner, [{"prompt": "p"}])
    check_reward_records(runner, records[:2], source="gsm8k:train")  # complete records pass
