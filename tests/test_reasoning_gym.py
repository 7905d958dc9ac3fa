"""reasoning-gym as a prompt source (`reasoning_gym:TASK?size=N&seed=S`) and the `reasoning_gym` reward."""

from __future__ import annotations

import pytest

from posttrain.data import read_prompts
from posttrain.data.sources import DataError, read_records
from posttrain.rewards import RewardRunner, load_reward


def test_source_generates_records_deterministically_per_seed():
    recs = read_records("reasoning_gym:chain_sum?size=20&seed=1")
    assert len(recs) == 20
    assert set(recs[0]) == {"prompt", "answer", "rg_source", "rg_index"}
    assert recs == read_records("reasoning_gym:chain_sum?size=20&seed=1")
    held_out = read_records("reasoning_gym:chain_sum?size=20&seed=2")
    assert {r["prompt"] for r in recs}.isdisjoint({r["prompt"] for r in held_out}) or \
        [r["prompt"] for r in recs] != [r["prompt"] for r in held_out]
    two_terms = read_records("reasoning_gym:chain_sum?size=5&seed=1&min_terms=2&max_terms=2")
    assert all(r["prompt"].count("+") + r["prompt"].count(" - ") == 1 for r in two_terms)
    assert read_prompts("reasoning_gym:basic_arithmetic?size=3&seed=0")[0]["prompt"]


def test_bad_sources_are_clear_errors():
    with pytest.raises(DataError, match="cannot create task 'no_such_task'"):
        read_records("reasoning_gym:no_such_task?size=3")
    with pytest.raises(DataError, match="no task named"):
        read_records("reasoning_gym:?size=3")


def test_reward_uses_the_task_checker():
    fn = load_reward("reasoning_gym")
    recs = read_records("reasoning_gym:chain_sum?size=4&seed=3")
    gold = [r["answer"] for r in recs]
    fields = dict(rg_source=[r["rg_source"] for r in recs], rg_index=[r["rg_index"] for r in recs])
    right = [f"Let me add.\n<answer>{g}</answer>" for g in gold]
    assert fn(None, right, **fields) == [1.0] * 4
    assert fn(None, [f"<answer>{int(g) + 1}</answer>" for g in gold], **fields) == [0.0] * 4
    assert fn(None, [f"<answer>{g}.00</answer>" for g in gold], **fields) == [1.0] * 4  # the checker's tolerance
    assert fn(None, [f"So the answer is {g}." for g in gold], **fields) == [1.0] * 4  # math fallback
    assert fn(None, [f"So the answer is {g}." for g in gold], fallback="none", **fields) == [0.0] * 4
    countdown = read_records("reasoning_gym:countdown?size=2&seed=0")  # a checker that evaluates expressions
    cfields = dict(rg_source=[r["rg_source"] for r in countdown], rg_index=[r["rg_index"] for r in countdown])
    assert fn(None, [f"<answer>{r['answer']}</answer>" for r in countdown], **cfields) == [1.0, 1.0]
    assert fn(None, ["<answer>1 + 1</answer>"] * 2, **cfields) < [1.0, 1.0]


def test_reward_runs_in_the_reward_pool():
    recs = read_records("reasoning_gym:basic_arithmetic?size=6&seed=5")
    fields = {"rg_source": [r["rg_source"] for r in recs], "rg_index": [r["rg_index"] for r in recs]}
    completions = [f"<answer>{r['answer']}</answer>" if i % 2 == 0 else "<answer>nope</answer>" for i, r in enumerate(recs)]
    with RewardRunner(["reasoning_gym"], num_workers=1) as runner:
        total, per, stats = runner.score([r["prompt"] for r in recs], completions, fields)
    assert total.tolist() == [1.0, 0.0] * 3
    assert stats["reward/reasoning_gym/failures"] == 0
